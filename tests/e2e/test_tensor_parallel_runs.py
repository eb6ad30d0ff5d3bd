"""A tensor-parallel target group over gloo trains as the colocated run does, step for step."""

import json

import pytest
from runs import read_metrics, run_colocated, run_disaggregated

from dflash.distributed.tensor_parallel import transformers_unsupported
from dflash.distributed.topology import TopologyError
from dflash.run.build import build_job
from dflash.run.config import compose_config


def test_two_target_ranks_sharing_one_target_train_like_colocated(tmp_path):
    """The demo target sharded over ranks 0 and 1 (read shard by shard from its checkpoint),
    one drafter rank: rank 0 sends every bundle, rank 1 prefills beside it and sends none."""
    run_colocated(tmp_path / "colocated", [])
    run_disaggregated(tmp_path / "split", 3, 2, ["target.tensor_parallel=2"])
    expected = [m["loss"] for m in read_metrics(tmp_path / "colocated")]
    assert len(expected) == 10
    # fp32 on the CPU; the row-parallel sums and the gradient sums run in another order
    assert [m["loss"] for m in read_metrics(tmp_path / "split")] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    ranks = json.loads((tmp_path / "split" / "ranks.json").read_text())
    assert [(r["rank"], r["role"], r["steps"]) for r in ranks] == [(0, "target", 10), (1, "target", 10),
                                                                   (2, "drafter", 10)]
    assert ranks[0]["bytes_sent"] > 0 and ranks[1]["bytes_sent"] == 0
    assert (tmp_path / "split" / "export" / "model.safetensors").is_file()


@pytest.mark.parametrize("overrides,error", [
    (["topology.mode=colocated"], "topology.mode=colocated holds a whole target"),
    (["eval.every=2"], "eval.every=2"),
])
def test_what_a_sharded_target_cannot_do_is_refused(tmp_path, overrides, error):
    cfg = compose_config(["wandb.mode=disabled", "target.tensor_parallel=2", f"output_dir={tmp_path}", *overrides])
    with pytest.raises((TopologyError, ValueError), match=error):
        build_job(cfg)


def test_a_transformers_older_than_the_tensor_parallel_api_is_refused_before_loading(tmp_path, monkeypatch):
    import transformers

    assert transformers_unsupported("5.23.0") is None and transformers_unsupported("6.0.0.dev0") is None
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    cfg = compose_config(["wandb.mode=disabled", "target.tensor_parallel=2", f"output_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"needs transformers >= 5\.23, found 5\.17\.0: pip install -U transformers"):
        build_job(cfg)
