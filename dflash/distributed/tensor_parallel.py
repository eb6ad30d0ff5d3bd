"""One target replica over several ranks: transformers' tensor-parallel plan on a group.

``target.tensor_parallel=k`` shards the target over ``k`` target ranks with the plan
transformers ships for the family (``base_model_tp_plan``: attention and MLP
projections column- then row-wise, the embedding over the vocabulary, MoE experts
each split over the group by ``moe_tp_experts``). After each row-wise projection the
partial outputs are all-reduced, so every decoder layer's output, the feature the
capture hooks read, is the complete tensor on every rank of the group.

The group is one of the job's process groups (:class:`dflash.distributed.protocol.Protocol`
creates it on every rank), not the whole world: transformers' own
``from_pretrained(distributed_config=...)`` builds its device mesh over every process,
drafters included, so the loading here hands it a mesh over the group instead.
"""

from __future__ import annotations

import os
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.distributed.configuration_utils import DistributedConfig
from transformers.distributed.tensor_parallel import apply_tensor_parallelism

from dflash.distributed.topology import TopologyError
from dflash.model.target import TargetSource, random_target, resolve_path


class GroupMesh:
    """The one mesh transformers asks for, whatever axes it names: the target group
    is this job's only parallel axis for the target."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh

    def get_mesh(self, dims: str | tuple[str, ...]) -> DeviceMesh:
        return self.mesh


def group_mesh(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """A one-dimensional mesh over an existing group (creates no group, runs no collective)."""
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("tp",))


def distributed_config(group: dist.ProcessGroup) -> DistributedConfig:
    return DistributedConfig(tp_size=dist.get_world_size(group), tp_plan="auto")


SINCE = (5, 23)  # the plan resolved for a mesh (_resolve_parallel_plans) and from_pretrained's hook as used here


def transformers_unsupported(version: str | None = None) -> str | None:
    """Why this transformers cannot shard a target, or None. The tensor-parallel API used
    here arrived in 5.23; with an earlier one loading would fail deep inside transformers
    (an attribute missing, a hook called with other arguments), on every rank of the group."""
    import transformers  # the module now in sys.modules (a reload replaces it)

    version = version or transformers.__version__
    if tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", version).groups()) < SINCE:
        return f"target.tensor_parallel needs transformers >= {'.'.join(map(str, SINCE))}, found {version}"
    return None


def check_transformers() -> None:
    if why := transformers_unsupported():
        raise ValueError(f"{why}: pip install -U transformers, or set target.tensor_parallel=1")


def check_plan(model_class: type, config: PretrainedConfig) -> None:
    """A family without a tensor-parallel plan in transformers cannot be sharded: refused
    before anything loads, with the key to change."""
    text = config.get_text_config()
    if not (getattr(model_class, "_tp_plan", None) or getattr(text, "base_model_tp_plan", None)):
        raise ValueError(
            f"target.tensor_parallel: transformers has no tensor-parallel plan for {text.model_type} "
            f"({model_class.__name__}); set target.tensor_parallel=1"
        )


def check_heads(config: PretrainedConfig, k: int) -> None:
    """Attention shards whole heads: each head count must divide by ``k``."""
    text = config.get_text_config()
    counts = {key: getattr(text, key, None) for key in ("num_attention_heads", "num_key_value_heads",
                                                      "linear_num_key_heads", "linear_num_value_heads")}
    bad = {key: n for key, n in counts.items() if n and n % k}
    if bad:
        raise ValueError(f"target.tensor_parallel={k} must divide every head count of the target, "
                         f"not {bad}; lower target.tensor_parallel")


def shard(model: nn.Module, group: dist.ProcessGroup, device: torch.device) -> nn.Module:
    """Shard a built model (a random target, the same on every rank of the group) in place:
    each rank keeps a copy of its slice of every sharded weight and the full ones are freed."""
    check_plan(type(model), model.config)
    tp_plan, _, _ = model._resolve_parallel_plans(distributed_config(group))
    return apply_tensor_parallelism(model, group_mesh(group, device), tp_plan)


def load_target(source: TargetSource, device: torch.device, dtype: torch.dtype, group: dist.ProcessGroup) -> nn.Module:
    """This rank's shard of one replica of the frozen target over ``group``. A checkpoint
    is read shard by shard; a random target is drawn whole on the device from the seed,
    the same on every rank, then sliced, so it equals the unsharded one."""
    config = source.config()
    check_heads(config, dist.get_world_size(group))
    if source.is_random:
        model = shard(random_target(config, device, dtype, source.seed), group, device)
    else:
        model = load_sharded(resolve_path(source.path), source.loading(config, dtype), group, device)
    return model.eval().requires_grad_(False)


def load_sharded(path, options: dict, group: dist.ProcessGroup, device: torch.device) -> nn.Module:
    """``from_pretrained`` (with ``options``) where each rank reads only its shard of every
    sharded weight (transformers' loader slices the safetensors to the DTensor placements),
    on the host, then moves it to ``device``."""
    config = options["config"]
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if model_class is None:
        raise ValueError(f"target.tensor_parallel needs a family transformers ships, not {type(config).__name__}; "
                         "set target.tensor_parallel=1")
    check_plan(model_class, config)
    mesh = GroupMesh(group_mesh(group, device))

    class OnGroup(model_class):
        @classmethod
        def prepare_distribute_model(cls, distributed, device_map=None):
            return distributed, None, mesh

    OnGroup.__name__ = model_class.__name__
    return OnGroup.from_pretrained(path, distributed_config=distributed_config(group), **options).to(device)


def check_placement(groups: list[list[int]], per_node: int) -> None:
    """A group's reductions run once per layer: its ranks must share a node (NVLink, not
    the network). Ranks are numbered node by node, ``per_node`` to a node."""
    split = [g for g in groups if len({r // per_node for r in g}) > 1]
    if split:
        raise TopologyError(
            f"target groups {split} would span nodes of {per_node} ranks (LOCAL_WORLD_SIZE): each group of "
            "target.tensor_parallel ranks must sit on one node; make target.tensor_parallel divide the ranks "
            "per node (--nproc_per_node)"
        )


def ranks_per_node(world_size: int) -> int:
    """``LOCAL_WORLD_SIZE`` under torchrun; a dry run without it plans nodes of 8 GPUs."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", min(world_size, 8)))
