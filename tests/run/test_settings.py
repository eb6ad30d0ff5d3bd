"""The settings the roles get are the config resolved: no interpolation reaches them."""

from pathlib import Path

from runs import compose_cfg

from dflash.run.settings import run_settings


def test_wandb_mode_follows_the_environment(monkeypatch):
    """``WANDB_MODE`` sets ``wandb.mode`` when the command line does not, as W&B's own
    convention has it; the metrics logger gets the value, not the interpolation."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert run_settings(compose_cfg([])).wandb["mode"] == "disabled"
    monkeypatch.setenv("WANDB_MODE", "online")
    assert run_settings(compose_cfg([])).wandb["mode"] == "online"
    assert run_settings(compose_cfg(["wandb.mode=offline"])).wandb["mode"] == "offline"
    monkeypatch.delenv("WANDB_MODE")
    assert run_settings(compose_cfg([])).wandb["mode"] == "offline"


def test_every_path_of_a_run_sits_under_its_output_dir(tmp_path):
    run_dir = run_settings(compose_cfg([f"output_dir={tmp_path}"])).run_dir
    paths = {name: getattr(run_dir, name) for name in run_dir.__dataclass_fields__ if name != "root"}
    assert all(Path(p).parent == tmp_path for p in paths.values())
    assert len(set(paths.values())) == len(paths)
