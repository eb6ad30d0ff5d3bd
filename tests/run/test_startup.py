"""The start-up line: each phase's seconds up to the end of the first step's training."""

import sys

from runs import run_colocated

from dflash.run.checkpoint import CheckpointWriter
from dflash.run.startup import phases


def test_the_first_step_ends_before_its_checkpoint_is_taken(tmp_path, monkeypatch):
    """A one-step run checkpoints at step 1: the copy to host memory takes seconds at real
    shapes (9 s for a Qwen3-8B-sized drafter), which is the checkpoint's time, not the
    step's, so the line's last phase ends before the save begins."""
    events: list[str] = []
    mark, save = phases.mark, CheckpointWriter.save

    def marked(phase: str) -> None:
        events.append(phase)
        mark(phase)

    def saved(self, step, *args) -> None:
        events.append(f"save {step}")
        save(self, step, *args)

    monkeypatch.setattr(phases, "mark", marked)
    monkeypatch.setattr(CheckpointWriter, "save", saved)
    run_colocated(tmp_path, ["train.max_steps=1"])
    assert events[-2:] == ["the first step", "save 1"]
    assert events[0] == "imports and the config" and "the compile warmup" in events


def test_the_line_says_when_every_import_was_compiled_from_source(tmp_path, monkeypatch):
    """Without bytecode to read or write, imports take more than twice as long: the
    line names the cause and the remedy, and only then."""
    monkeypatch.setattr(phases, "phases", [("imports and the config", 13.0)])
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert "compiled from source" not in phases.report()
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path))  # where no bytecode is cached
    assert "PYTHONDONTWRITEBYTECODE" in phases.report()
