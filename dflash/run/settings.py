"""What the roles need of the config, resolved once into frozen objects.

The builders read the Hydra config; the roles, the step loop and the evaluations
get a :class:`RunSettings` and a :class:`RunDir` instead, so every path of a run
directory and every setting has one route from the command line to its use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from dflash.decode.evaluate import BASELINE_FILE
from dflash.decode.live import LiveEvalSettings
from dflash.decode.speculative import DecodeSettings
from dflash.distributed.topology import TopologyError

GIB = 2**30
H200_GIB = 139.8  # usable memory of one H200 as torch reports it
LAYOUT_MODES = ("auto", "colocated", "disaggregated")


@dataclass(frozen=True)
class RunDir:
    """Every path a run writes under ``output_dir`` (README, "Output files")."""

    root: Path
    config: Path  # config.yaml, the resolved config
    checkpoints: Path
    export: Path
    eval_report: Path  # eval.json, the export's evaluation
    warmup: Path  # warmup.json, what each rank compiled or loaded
    ranks: Path  # ranks.json, every rank's summary

    @classmethod
    def at(cls, root: Path) -> RunDir:
        return cls(root, root / "config.yaml", root / "checkpoints", root / "export", root / "eval.json",
                   root / "warmup.json", root / "ranks.json")


@dataclass(frozen=True)
class ExportEval:
    """The held-out evaluation of the export at the end of a completed run."""

    prompts_path: str
    decode: DecodeSettings


@dataclass(frozen=True)
class RunSettings:
    """The config as the roles use it."""

    run_dir: RunDir
    resume: str  # auto, never, or a checkpoint directory
    log_every: int
    max_nonfinite: int  # skipped steps in a row that end the run
    checkpoint_every: int  # 0: only at the end and on SIGTERM
    checkpoint_keep: int
    max_in_flight: int  # bundles a target rank has sent and not seen received
    target_name: str  # for the evaluation report
    wandb: dict
    config: dict  # the whole resolved config, for W&B
    export_eval: ExportEval | None
    live: LiveEvalSettings | None

    def checkpoint_due(self, step: int) -> bool:
        return bool(self.checkpoint_every) and step % self.checkpoint_every == 0


def template_kwargs(cfg: DictConfig) -> dict:
    """The chat template arguments training renders prompts with (absent for synthetic data)."""
    return dict(cfg.data.get("chat_template_kwargs") or {})


def decode_settings(cfg: DictConfig) -> DecodeSettings:
    """The ``eval`` group's budgets, greedy, with the template arguments training renders with."""
    batch_size = None if cfg.eval.batch_size is None else int(cfg.eval.batch_size)
    return DecodeSettings(max_new_tokens=int(cfg.eval.max_new_tokens), max_prompts=int(cfg.eval.max_prompts),
                          batch_size=batch_size, template_kwargs=template_kwargs(cfg))


def eval_every(cfg: DictConfig) -> int:
    """``eval.every`` when evaluations while training will run (``eval.enabled``), else 0."""
    return int(cfg.eval.get("every") or 0) if cfg.eval.enabled else 0


def check_eval_budgets(cfg: DictConfig) -> None:
    """Refuse budgets below one at start, for the export's evaluation too."""
    if cfg.eval.enabled:
        for key in ("max_prompts", "max_new_tokens"):
            if int(cfg.eval[key]) < 1:
                raise ValueError(f"eval.{key}={cfg.eval[key]} must be at least 1 (or eval.enabled=false)")
    if cfg.eval.batch_size is not None and int(cfg.eval.batch_size) < 1:
        raise ValueError(f"eval.batch_size={cfg.eval.batch_size} must be at least 1, or null (64 on a GPU, 32 on the CPU)")


def live_eval_settings(cfg: DictConfig) -> LiveEvalSettings | None:
    """``None`` unless ``eval.every > 0``, which then needs held-out prompts."""
    check_eval_budgets(cfg)
    every = eval_every(cfg)
    if every <= 0:
        return None
    if not cfg.data.eval_path:
        raise ValueError(f"eval.every={every} needs held-out prompts: set data.eval_path")
    temperature = cfg.eval.get("temperature")
    temperatures = (0.0,) if temperature is None else (0.0, float(temperature))
    return LiveEvalSettings(every, str(cfg.data.eval_path), replace(decode_settings(cfg), temperatures=temperatures),
                            baseline_path=str(Path(cfg.output_dir) / BASELINE_FILE))


def export_eval(cfg: DictConfig) -> ExportEval | None:
    """The end-of-run evaluation, when ``eval.enabled`` and there are held-out prompts."""
    check_eval_budgets(cfg)
    if not (cfg.eval.enabled and cfg.data.eval_path):
        return None
    return ExportEval(str(cfg.data.eval_path), decode_settings(cfg))


def run_settings(cfg: DictConfig) -> RunSettings:
    return RunSettings(
        run_dir=RunDir.at(Path(cfg.output_dir)),
        resume=str(cfg.resume),
        log_every=int(cfg.train.log_every),
        max_nonfinite=int(cfg.train.max_nonfinite),
        checkpoint_every=int(cfg.checkpoint.every or 0),
        checkpoint_keep=int(cfg.checkpoint.keep),
        max_in_flight=int(cfg.topology.max_in_flight),
        target_name=str(OmegaConf.select(cfg, "target.path", default="")),  # missing in a dry run of a preset
        wandb=OmegaConf.to_container(cfg.wandb, resolve=True),
        config=OmegaConf.to_container(cfg, resolve=True),
        export_eval=export_eval(cfg),
        live=live_eval_settings(cfg),
    )


@dataclass(frozen=True)
class LayoutSettings:
    """What choosing the layout (:mod:`dflash.run.layout`) and counting its cost
    (:mod:`dflash.run.estimate`) read of the config: the ``topology`` and ``estimate``
    groups and the micro-batch keys, checked once. Neither module reads anything else."""

    mode: str  # topology.mode: auto, colocated or disaggregated
    target_ranks: int | None  # topology.target_ranks; None: auto
    max_in_flight: int  # bundles a target rank may have in flight
    auto_micro_batch: bool  # train.micro_batch_size=auto: the token budget's choice may be stepped down
    micro_batch_tokens: int  # train.micro_batch_tokens, the budget's
    device: str | None  # estimate.device: cuda, cpu, or None for this machine's
    device_gib: float  # estimate.device_gib, else the visible GPU's, else an H200's
    rates_path: str  # estimate.rates: a dflash.bench report whose rates predict samples/s; "": the H200's
    rates_report: dict | None  # that report, read once
    graphs: bool  # compile.mode=reduce-overhead: the drafter step's graph holds a copy of its inputs
    flash: bool  # flex attention on FlashAttention-4's kernels (compile.attention=flash, resolved)
    mean_length: float | None  # the mean sample length of data=synthetic with data.mean_length
    live_every: int  # evaluations while training every so many steps; 0: none
    tensor_parallel: int  # target ranks per target replica
    target: str  # "name (path)", for the plan's first line
    card: str | None = None  # the visible GPU's name, None without one (the plan names the card its rates are from)
    fp8_drafter: bool = False  # train.fp8: the drafter's linear layers in FP8
    fp8_target: bool = False  # target.fp8: the prefill's decoder layers in FP8

    def for_cuda(self, world_size: int) -> bool:
        """Whether the plan is for GPUs (bf16 weights, H200 rates) or the CPU (float32, no
        rate): ``estimate.device`` when set, so that a 1-GPU run can be planned from a
        machine without one; else the run this command would start here, on GPUs where
        there is one or where the plan spans several ranks."""
        if self.device is None:
            return torch.cuda.is_available() or world_size > 1
        return self.device == "cuda"


def layout_settings(cfg: DictConfig, *, flash: bool, tensor_parallel: int, live_every: int,
                    target_path: str) -> LayoutSettings:
    """The :class:`LayoutSettings` of ``cfg``, with what the job resolved beside it.
    Raises for a mode, a split or a device the plan cannot take."""
    topology, estimate, train = cfg.topology, cfg.estimate, cfg.train
    if topology.mode not in LAYOUT_MODES:
        raise TopologyError(f"topology.mode={topology.mode} is not one of {', '.join(LAYOUT_MODES)}")
    if topology.mode == "colocated" and topology.target_ranks not in ("auto", 0):
        raise TopologyError(f"topology.target_ranks={topology.target_ranks} splits the ranks into targets and "
                            "drafters, and topology.mode=colocated runs both on every rank: drop one of the two")
    if estimate.device not in (None, "cuda", "cpu"):
        raise ValueError(f"estimate.device={estimate.device!r}: choose cuda, cpu or null (this machine's)")
    if estimate.device_gib:
        device_gib = float(estimate.device_gib)
    elif torch.cuda.is_available():
        device_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    else:
        device_gib = H200_GIB
    rates = str(estimate.rates or "")
    synthetic = cfg.data.path == "synthetic" and cfg.data.get("mean_length")
    return LayoutSettings(
        mode=str(topology.mode),
        target_ranks=None if topology.target_ranks == "auto" else int(topology.target_ranks),
        max_in_flight=int(topology.max_in_flight),
        auto_micro_batch=train.micro_batch_size == "auto",
        micro_batch_tokens=int(train.micro_batch_tokens),
        device=estimate.device,
        device_gib=device_gib,
        rates_path=rates,
        rates_report=json.loads(Path(rates).read_text()) if rates else None,
        graphs=cfg.compile.mode == "reduce-overhead",
        flash=flash,
        mean_length=cfg.data.mean_length if synthetic else None,
        live_every=live_every,
        tensor_parallel=tensor_parallel,
        target=f"{cfg.target.name} ({target_path})",
        card=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        fp8_drafter=bool(train.fp8),
        fp8_target=bool(cfg.target.fp8),
    )
