"""recipes/smollm2.sh on the CPU with a tiny slice: a tiny Llama chat model written as GGUF
by the ``gguf`` package stands in for SmolLM2 (same special tokens, so the same preset and
mask token), and the fixture HumanEval rows for the real ones; every step runs and the
table is written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_fixture import tiny_llama, write_gguf

ROOT = Path(__file__).parents[2]
TINY_TRAIN = ("wandb.mode=disabled train.max_steps=2 train.batch_size=2 train.micro_batch_size=1 train.num_anchors=8 "
              "drafter.num_layers=1 drafter.block_size=8 drafter.target_layer_ids=[0] data.min_loss_tokens=2 "
              "eval.max_prompts=2")


RECIPE_ENV = {"MAX_TASKS": "20", "DEMO": "6", "REPEATS": "1", "MAX_NEW": "12", "SAMPLES": "2", "SPEED_PROMPTS": "2",
              "TRAIN_OVERRIDES": TINY_TRAIN, "REGEN_ARGS": "--keep-truncated --batch-size 8", "EVAL_ARGS": "--device cpu",
              "HUMANEVAL": str(ROOT / "tests" / "fixtures" / "benchmarks" / "humaneval.jsonl")}


def run(tmp_path: Path, script: str = "smollm2.sh", **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "TARGET_DIR": str(tmp_path / "target"),
           "GGUF": str(write_gguf(tiny_llama(), tmp_path / "tiny.gguf")), **RECIPE_ENV, **env}
    # the bound holds only a hang: the recipe took 120 s at -n 4 on 2 idle cores, up to 391 s on 2 busy ones
    return subprocess.run([str(ROOT / "recipes" / script), str(tmp_path / "work")], env=env,
                          capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The recipe run once: its directory and its output."""
    tmp_path = tmp_path_factory.mktemp("recipe")
    return tmp_path, run(tmp_path)


def test_the_smollm2_recipe_runs_end_to_end_on_a_tiny_gguf_target(recipe):
    tmp_path, out = recipe
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    work = tmp_path / "work"
    assert (tmp_path / "target" / "model.safetensors").is_file()
    plan = (work / "plan.txt").read_text()  # the hours: bounded before the prompts, counted after
    prompts = len((work / "prompts" / "train.jsonl").read_text().splitlines())
    assert "training: at most " in plan and f"training: {2 * prompts} samples x 6 epochs" in plan
    assert out.stdout.index("training: at most") < out.stdout.index("== the prompts") < out.stdout.index("== train")
    assert (work / "run" / "export" / "config.json").is_file()
    table = (work / "table.md").read_text().splitlines()
    assert table[0].startswith("| set | responses | tau | capped |")
    assert [row.split(" | ")[0][2:] for row in table[2:4]] == ["humaneval", "heldout"]
    assert table[2].split(" | ")[1] == "2" and all(" yes " in row for row in table[2:4])
    assert any("last cycle up to its stop token" in line for line in table)
    assert any(row.startswith("| prompt lookup (10) | 1 |") for row in table)


def test_a_dry_run_states_the_plan_and_hours_and_trains_nothing(tmp_path):
    out = run(tmp_path, DRY_RUN="1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cost of smollm2_135m" in out.stdout and "training: " in out.stdout
    # before the target answers anything: the prompts are not built, their count is bounded
    work = tmp_path / "work"
    assert not (work / "asked.jsonl").exists() and not (work / "prompts").exists() and not (work / "run").exists()
    bound = 2 * (int(RECIPE_ENV["MAX_TASKS"]) + int(RECIPE_ENV["DEMO"]) + int(RECIPE_ENV["REPEATS"]) * 80 * 5)
    assert f"training: at most {bound} samples x 6 epochs" in out.stdout


def test_the_study_trains_each_variant_on_the_recipes_data_and_plots_tau_against_samples(recipe):
    """The two variants whose overrides change the drafter's shape (the other two change only
    the loss: ce is the recipe's own run, kl the e2e KL tests'), to keep the suite short."""
    tmp_path, _ = recipe
    tiny = TINY_TRAIN.replace("drafter.num_layers=1", "drafter.num_layers=5")  # the sliding variant names 5 layers
    out = run(tmp_path, "smollm2_study.sh", TRAIN_OVERRIDES=tiny, EVAL_EVERY="1", EVAL_PROMPTS="2",
              VARIANTS="dflash2 sliding")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    study = tmp_path / "work" / "study"
    table = (study / "study.md").read_text().splitlines()
    assert [row.split(" | ")[0][2:] for row in table[2:4]] == ["dflash2", "sliding"] and not table[4]
    for row in table[2:4]:
        cells = row.split(" | ")
        assert cells[2] != "-" and cells[6] != "-"  # tau on HumanEval and held out
        assert cells[5] == "yes" and cells[9] == "yes" and cells[10] == "2"  # lossless; 2 steps each
    assert (study / "study.png").stat().st_size > 10_000
    configs = {v: (study / v / "run" / "export" / "config.json").read_text() for v in ("dflash2", "sliding")}
    assert '"block_size": 8' in configs["dflash2"] and "sliding_attention" in configs["sliding"]


def test_the_study_refuses_a_directory_the_recipe_has_not_filled(tmp_path):
    out = run(tmp_path, "smollm2_study.sh")
    assert out.returncode == 2 and "run recipes/smollm2.sh" in out.stderr
    out = run(tmp_path, "smollm2_study.sh", VARIANTS="ce swa")
    assert out.returncode == 2 and "unknown variant 'swa'" in out.stderr
