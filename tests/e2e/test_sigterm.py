"""SIGTERM saves a checkpoint at a step boundary and the job ends (no hang)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runs import TINY

ROOT = Path(__file__).resolve().parents[2]
# Bounds that hold only a hang, never a slow machine: from launch to the first steps (the whole
# test: 42 s at -n 4 on 2 idle cores, up to 117 s on 2 busy ones), and from SIGTERM to the end.
STARTS_S = 600
ENDS_S = 300


# one process, and a target with two drafters over gloo
LAYOUTS = pytest.mark.parametrize(
    "cmd",
    [
        [sys.executable, "-m", "dflash.train"],
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", "-m", "dflash.train", "topology.target_ranks=1"],
    ],
    ids=["colocated", "disaggregated"],
)


def launch(cmd: list[str], output_dir: Path, extra: list[str] = ()) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    overrides = [o for o in TINY if not o.startswith("train.max_steps")] + ["train.max_steps=500", f"output_dir={output_dir}"]
    overrides += list(extra)
    return subprocess.Popen(cmd + overrides, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_steps(proc: subprocess.Popen, metrics: Path, steps: int, timeout: float = STARTS_S) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        if proc.poll() is not None:
            pytest.fail(f"training exited early:\n{proc.stdout.read()}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail("training did not reach the first steps in time")


def terminate(proc: subprocess.Popen) -> str:
    """SIGTERM, then the job's output once it has exited (a failure if it hangs)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=ENDS_S)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the job hung after SIGTERM")


@LAYOUTS
def test_sigterm_checkpoints_and_exits(tmp_path, cmd):
    proc = launch(cmd, tmp_path)
    wait_for_steps(proc, tmp_path / "metrics.jsonl", 3)
    out = terminate(proc)
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert saved, out
    step = int(saved[-1].name.split("_")[1])
    assert 3 <= step < 500
    assert not (tmp_path / "export").exists(), "an interrupted run does not export"


@LAYOUTS
def test_sigterm_abandons_an_evaluation_while_training(tmp_path, cmd):
    """An evaluation running at SIGTERM (64 prompts x 256 tokens: a minute on the CPU) is
    dropped, so the checkpoint comes within the grace period, not after the decoding."""
    long_eval = ["eval.enabled=true", "eval.every=2", "eval.max_prompts=64", "eval.max_new_tokens=256"]
    proc = launch(cmd, tmp_path, long_eval)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + STARTS_S
    while not (metrics.is_file() and '"step": 2, "loss"' in metrics.read_text()):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"training did not reach step 2:\n{proc.stdout.read()}")
        time.sleep(0.1)
    # step 2's record is written just before its evaluation starts; a SIGTERM in between
    # rightly skips the evaluation, so give it a second to be under way (it runs a minute)
    time.sleep(1.0)
    out = terminate(proc)
    assert "the evaluation of step 2 is abandoned" in out, out[-4000:]
    assert sorted((tmp_path / "checkpoints").glob("step_*")), out[-4000:]
    assert '"eval/tau"' not in metrics.read_text()
