"""Tensor-parallel target groups: the schedule treats a group as one target, the plan refuses
what cannot run, and a target sharded over two gloo ranks captures the very features of the
unsharded one (fp32 on the CPU), from random weights and from a checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash.distributed.protocol import free_port, set_rank_env
from dflash.distributed.tensor_parallel import check_heads, check_placement
from dflash.distributed.topology import Topology, TopologyError, auto_target_ranks

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=256)
# family -> shape; each is loaded sharded from random weights and from a saved checkpoint
FAMILIES = {
    "qwen3": TINY,
    "llama": TINY,
    "qwen3_moe": {**TINY, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    # the Qwen3.5-122B-A10B family: Gated DeltaNet and full-attention layers, experts and a shared expert
    "qwen3_5_moe_text": {**TINY, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                         "shared_expert_intermediate_size": 32, "linear_num_key_heads": 2,
                         "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
}
LAYERS = [0, 2]


def topo(t: int, d: int, k: int, rank: int = 0, a: int = 2) -> Topology:
    return Topology(world_size=t + d, rank=rank, num_targets=t, micro_batch_size=1, batch_size=a * d, tensor_parallel=k)


@pytest.mark.parametrize("t,d,k", [(2, 1, 2), (4, 3, 2), (6, 2, 3), (8, 8, 4)])
def test_a_group_is_one_target_in_the_schedule(t, d, k):
    """Every rank of a group prefills its group's micro-batches; only the leader sends,
    and the sends cover every micro-batch once, as T / k plain targets would."""
    tp, plain = topo(t, d, k), topo(t // k, d, 1)
    last = 40
    assert tp.senders == list(range(0, t, k)) and tp.num_groups == t // k
    for rank in range(t):
        group = rank // k
        assert tp.produced_by(rank, 3, last) == plain.produced_by(group, 3, last)
    assert [tp.producer(m) for m in range(last)] == [plain.producer(m) * k for m in range(last)]
    assert [tp.consumer(m) - t for m in range(last)] == [plain.consumer(m) - t // k for m in range(last)]
    assert [topo(t, d, k, rank=r).is_sender for r in range(t + d)] == [r < t and r % k == 0 for r in range(t + d)]


def test_refusals_name_the_key_to_change():
    with pytest.raises(TopologyError, match="positive multiple of 2.*topology.target_ranks or target.tensor_parallel"):
        topo(3, 1, 2)
    with pytest.raises(TopologyError, match="multiple of 2"):
        Topology(world_size=4, rank=0, num_targets=0, micro_batch_size=1, batch_size=4, tensor_parallel=2)
    with pytest.raises(TopologyError, match=r"\[\[4, 5, 6, 7\]\] would span nodes of 6 ranks"):
        check_placement(topo(8, 4, 4).target_groups, 6)
    check_placement(topo(8, 8, 4).target_groups, 8)
    check_placement(topo(2, 1, 2).target_groups, 3)  # one node of 3: the group [0, 1] sits on it
    with pytest.raises(TopologyError, match="leaves no drafter"):
        auto_target_ranks(2, 70e9, 1e8, 16, 4096, tensor_parallel=2)
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="divide every head count.*num_key_value_heads"):
        check_heads(AutoConfig.for_model("qwen3", **TINY), 4)


def test_auto_split_takes_whole_groups():
    assert auto_target_ranks(8, 70e9, 1e8, 16, 4096, tensor_parallel=2) == 6
    assert auto_target_ranks(16, 70e9, 1e8, 16, 4096, tensor_parallel=4) == 12
    assert auto_target_ranks(3, 8e9, 8e9, 512, 64, tensor_parallel=2) == 2


def _worker(rank: int, port: int, out: str) -> None:
    set_rank_env(rank, 2, port)
    torch.set_num_threads(1)
    from dflash.distributed.tensor_parallel import load_target
    from dflash.model.target import Target, TargetSource

    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    results = {}
    for family, shape in FAMILIES.items():
        for path in ("random", str(Path(out) / family)):
            source = TargetSource(path, shape={"model_type": family, **shape}, seed=3)
            whole = Target(source.model(torch.device("cpu"), torch.float32), LAYERS)
            sharded = Target(load_target(source, torch.device("cpu"), torch.float32, group), LAYERS)
            expected, got = whole.prefill(ids, topk=4), sharded.prefill(ids, topk=4)
            plain = sharded.prefill(ids).features  # stops after the last captured layer
            results[f"{family}/{'random' if path == 'random' else 'checkpoint'}"] = {
                "features": float((got.features - expected.features).abs().max()),
                "stopped": float((plain - expected.features).abs().max()),
                "topk": float((got.topk_values - expected.topk_values).abs().max()),
                "sharded": sum(type(p).__name__ == "DTensor" for p in sharded.model.parameters()),
            }
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """One pair of gloo processes runs every family, from random weights and from a checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("tensor_parallel")
    for family, shape in FAMILIES.items():
        torch.manual_seed(5)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **shape)).save_pretrained(out / family)
    os.environ.pop("LOCAL_RANK", None)
    mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("case", [f"{f}/{w}" for f in FAMILIES for w in ("random", "checkpoint")])
def test_sharded_prefill_equals_the_single_rank_prefill(parity, case):
    for rank in (0, 1):
        result = parity[rank][case]
        assert result["sharded"] > 0
        # fp32: only the order of the row-parallel sums differs
        assert result["features"] < 1e-5 and result["stopped"] < 1e-5 and result["topk"] < 1e-5, result
