"""Regression pins of the transport: behaviours whose silent breakage would still train,
on the wrong data, checked in one process over a loopback that stands in for gloo."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dflash.data.bundle import MicroBatch
from dflash.distributed.transport import (
    BundleError,
    BundleReceiver,
    BundleSender,
    Expected,
)
from dflash.model.target import PrefillOutput

pytestmark = pytest.mark.usefixtures("one_thread")


class Loopback:
    """Point-to-point in one process, for the transport's own logic: a send queues a copy
    under its tag, a receive of that tag takes the oldest (gloo's matching, minus the wire)."""

    class Done:
        def wait(self) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    def __init__(self):
        self.queues: dict[int, list[torch.Tensor]] = {}

    def op(self, op, tensor: torch.Tensor, peer: int | None = None, group=None, tag: int = 0) -> SimpleNamespace:
        return SimpleNamespace(op=op, tensor=tensor, tag=tag)

    def batch_isend_irecv(self, ops: list[SimpleNamespace]) -> list[Done]:
        for o in ops:
            if o.op is dist.isend:
                self.queues.setdefault(o.tag, []).append(o.tensor.clone())
            else:
                o.tensor.copy_(self.queues[o.tag].pop(0))
        return [self.Done()]


def test_receiver_refuses_a_bundle_for_another_micro_batch(monkeypatch):
    """A drafter waiting for micro-batch 8 that gets micro-batch 7's bundle (ranks out of
    step) stops with a clear error instead of training on the wrong data; the right
    index goes through."""
    loop = Loopback()
    monkeypatch.setattr(dist, "P2POp", loop.op)
    monkeypatch.setattr(dist, "batch_isend_irecv", loop.batch_isend_irecv)
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    batch = MicroBatch(torch.randint(0, 50, (1, 16), generator=g), torch.ones(1, 16, dtype=torch.long),
                       torch.tensor([16]), torch.tensor([[3, 5]]), torch.tensor([[True, True]]), 0)
    prefill = PrefillOutput(torch.randn(1, 16, 12, generator=g))
    expected = Expected(max_batch=1, num_anchors=2, feature_dim=12, feature_dtype=torch.float32, topk=0,
                        buckets=[16], block_size=4)
    sender, receiver = BundleSender({1: None}, cpu, block_size=4), BundleReceiver({0: None}, cpu, expected)

    sender.send(1, 8, batch, prefill)
    header, got, got_prefill = receiver.receive(0, 8)
    assert header.micro_batch == 8 and torch.equal(got.input_ids, batch.input_ids)
    assert torch.equal(got_prefill.features, prefill.features)

    sender.send(1, 7, batch, prefill)
    with pytest.raises(BundleError) as refused:
        receiver.receive(0, 8)
    assert str(refused.value).endswith("does not match this drafter: micro-batch 7, expected 8")
