"""The Hydra config of a run: where it ships, composing it outside the command line,
and the target it names.

``conf/`` sits beside the package in a source checkout and is shipped inside the
wheel as ``dflash/conf`` (pyproject.toml maps it), so a plain ``pip install .``
finds it too. Only this module and the builders read a ``DictConfig``; what they
hand down is plain frozen objects.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dflash.model.target import RANDOM, TargetSource


def config_dir() -> Path:
    """The config directory: inside the installed package, else the checkout's ``conf/``."""
    package = Path(__file__).resolve().parents[1]
    shipped = package / "conf"
    return shipped if shipped.is_dir() else package.parent / "conf"


def compose_config(overrides: list[str]) -> DictConfig:
    """The config ``python -m dflash.train`` would see with these overrides (for
    benchmarks and tests, which run outside Hydra's command line)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def target_source(cfg: DictConfig) -> TargetSource:
    """``target.*`` as a source. A dry run plans from the preset's shape when the
    weights are not at hand (no ``target.path`` given, or not on this machine)."""
    target = cfg.target
    path = None if OmegaConf.is_missing(target, "path") else target.path
    absent = path is None or (path not in (RANDOM, "demo") and not Path(path).expanduser().is_dir())
    if cfg.dry_run and absent and target.get("shape"):
        path = RANDOM
    shape = OmegaConf.to_container(target.shape, resolve=True) if target.get("shape") else None
    return TargetSource(path if path is not None else target.path, target.trust_remote_code, shape,
                        cfg.train.seed, target.get("tokenizer"))
