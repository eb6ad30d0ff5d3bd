"""Disaggregated training over gloo equals colocated training, step for step."""

import json

import pytest
from runs import RANDOM_TARGET, read_metrics, run_colocated, run_disaggregated

KL = ["loss.kl_weight=0.5", "loss.kl_topk=8"]


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    runs = {}
    for name, extra in (("ce", []), ("kl", KL)):
        out = tmp_path_factory.mktemp(f"colocated_{name}")
        run_colocated(out, extra)
        runs[name] = [m["loss"] for m in read_metrics(out)]
    return runs


@pytest.mark.parametrize(
    "world,targets,loss",
    [(2, 1, "ce"), (3, 1, "kl"), (3, 2, "kl"), (4, 2, "ce")],
    ids=["T1D1-ce", "T1D2-kl", "T2D1-kl", "T2D2-ce"],
)
def test_losses_match_colocated(colocated, tmp_path, world, targets, loss):
    run_disaggregated(tmp_path, world, targets, KL if loss == "kl" else [])
    losses = [m["loss"] for m in read_metrics(tmp_path)]
    assert len(losses) == 10
    # fp32 on the CPU; only the order of the gradient and loss sums differs
    assert losses == pytest.approx(colocated[loss], rel=1e-5, abs=1e-6)
    assert (tmp_path / "export" / "model.safetensors").is_file()


def test_compiled_staggered_run_matches_eager(colocated, tmp_path):
    """Both roles compiled (aot_eager), strict guards, two warmup turns: same losses,
    no recompile after warmup, and the second turn starts after the first ends."""
    compiled = ["compile.enabled=true", "compile.backend=aot_eager", "compile.target=true", "compile.strict=true",
                "compile.warmup_turns=2"]
    run_disaggregated(tmp_path, 3, 1, KL + compiled)
    metrics = read_metrics(tmp_path)
    assert [m["loss"] for m in metrics] == pytest.approx(colocated["kl"], rel=1e-5, abs=1e-6)
    assert all(m["recompiles"] == 0 and m["cudagraph_skips"] == 0 and m["cudagraph_rerecords"] == 0 for m in metrics)
    reports = json.loads((tmp_path / "warmup.json").read_text())
    assert [(r["role"], r["turn"]) for r in reports] == [("target", 0), ("drafter", 0), ("drafter", 1)]
    assert all(r["graphs"] > 0 for r in reports)
    assert reports[2]["began"] >= max(reports[0]["ended"], reports[1]["ended"])


def split_matches_colocated(tmp_path, world: int, targets: int, overrides: list[str], steps: int) -> list[dict]:
    """Train colocated and split with the same overrides; the losses agree. Returns ranks.json."""
    run_colocated(tmp_path / "colocated", overrides)
    run_disaggregated(tmp_path / "split", world, targets, overrides)
    expected = [m["loss"] for m in read_metrics(tmp_path / "colocated")]
    assert len(expected) == steps
    assert [m["loss"] for m in read_metrics(tmp_path / "split")] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    return json.loads((tmp_path / "split" / "ranks.json").read_text())


def test_random_target_on_synthetic_data(tmp_path):
    """The throughput setup (random weights at a preset's shape, random tokens): two
    target ranks build the same target and the drafter ranks the same head."""
    ranks = split_matches_colocated(tmp_path, 3, 2, RANDOM_TARGET, steps=10)
    assert [(r["rank"], r["role"], r["steps"]) for r in ranks] == [(0, "target", 10), (1, "target", 10), (2, "drafter", 10)]
    assert ranks[2]["bytes_received"] > 0 and all(r["bytes_sent"] > 0 for r in ranks[:2])


def test_eight_ranks_two_targets_six_drafters_match_colocated(tmp_path):
    """The headline layout's rank count: groups that leave ranks out on both sides
    (12 pairs, a drafter group without the targets), accumulation over 6 drafters."""
    ranks = split_matches_colocated(tmp_path, 8, 2, ["train.batch_size=6", "train.max_steps=4"], steps=4)
    assert [r["role"] for r in ranks] == ["target"] * 2 + ["drafter"] * 6
    assert all(r["steps"] == 4 for r in ranks)
