"""The reducer's scope (an interleaved pipeline chunk's backward reduces only that chunk's
buckets) and the layout's kinds it relies on, in one process with a recording reduction."""

from __future__ import annotations

import pytest
import torch

from zerolap.zero.grad_storage import ShardGradients
from zerolap.zero.layout import build_layout
from zerolap.zero.reducer import GradReducer


class _Recorded:
    """A reduction over one rank that records which buckets it was launched for."""

    def __init__(self) -> None:
        self.launched: list[int] = []

    def launch(self, bucket, buffer):
        self.launched.append(bucket.index)

        class Done:
            def wait(self) -> None:
                pass

        return Done(), lambda: (buffer, bucket.layout.start, bucket.layout.end)


def test_buckets_hold_one_kind():
    layout = build_layout([4, 4, 4, 4], bucket_numel=100, world_size=1, kinds="aabb")
    assert [b.slots for b in layout.buckets] == [(0, 1), (2, 3)]
    layout = build_layout([4, 4, 4], bucket_numel=100, world_size=1, kinds=[0, 1, 0])
    assert [b.slots for b in layout.buckets] == [(0,), (1,), (2,)]
    assert len(build_layout([4, 4, 4], bucket_numel=100, world_size=1).buckets) == 1


def _reducer():
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(4)]
    layout = build_layout([4] * 4, bucket_numel=100, world_size=1, kinds="aabb")
    storage = ShardGradients(layout, 0, dtype=torch.float32, comm_dtype=torch.float32, device="cpu")
    reduction = _Recorded()
    reducer = GradReducer(params, layout, storage, reduction, overlap=True)
    reducer.begin_cycle()
    return params, storage, reduction, reducer


def test_a_scoped_backward_reduces_its_buckets_only():
    params, storage, reduction, reducer = _reducer()
    reducer.begin_backward(True, scope=frozenset({1}))
    (params[2] * 2 + params[3] * 3).sum().backward()
    reducer.finish_backward()
    assert reduction.launched == [1]  # bucket 0 was not reduced as zeros
    assert storage.shard.tolist() == [0.0] * 8 + [2.0] * 4 + [3.0] * 4


def test_a_bucket_no_round_reached_in_a_cycle_reads_as_zero():
    """A cycle's first round is copied into the shard, not added to zeros: a bucket that no
    round reached still holds the last cycle's sum until a reader settles the storage, which
    zeroes it, and a later round of the cycle then adds onto the zeros."""
    params, storage, _, reducer = _reducer()
    reducer.begin_backward(True)
    sum(p * (i + 5) for i, p in enumerate(params)).sum().backward()
    reducer.finish_backward()
    assert storage.shard.tolist() == [5.0] * 4 + [6.0] * 4 + [7.0] * 4 + [8.0] * 4
    reducer.begin_cycle()
    reducer.begin_backward(True, scope=frozenset({1}))
    (params[2] * 2 + params[3] * 3).sum().backward()
    reducer.finish_backward()
    storage.settle()
    assert storage.shard.tolist() == [0.0] * 8 + [2.0] * 4 + [3.0] * 4
    reducer.begin_backward(True)
    sum(params).sum().backward()
    reducer.finish_backward()
    assert storage.shard.tolist() == [1.0] * 8 + [3.0] * 4 + [4.0] * 4


def test_a_gradient_outside_the_scope_is_named():
    params, _, _, reducer = _reducer()
    reducer.begin_backward(True, scope=frozenset({1}))
    with pytest.raises(RuntimeError, match="reduces only buckets \\[1\\], not its bucket 0"):
        params[0].sum().backward()


@pytest.mark.parametrize("overlap", [True, False])
def test_stage_2_holds_at_most_its_pool_of_bucket_buffers(overlap):
    """Ten one-parameter buckets, gradients arriving in bucket order as the layout expects
    them: the storage never holds more than its pool of buffers, with or without
    ``overlap_comm`` (without it, ready buckets are reduced when the pool runs out, instead of
    every bucket keeping a buffer until the end of backward), and every gradient lands whole."""
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(10)]
    layout = build_layout([4] * 10, bucket_numel=4, world_size=1)
    storage = ShardGradients(layout, 0, dtype=torch.float32, comm_dtype=torch.float32, device="cpu")
    reducer = GradReducer(params, layout, storage, _Recorded(), overlap=overlap)
    reducer.begin_cycle()
    reducer.begin_backward(True)
    x = torch.ones(4)
    for p in reversed(params):  # backward reaches params[0] first
        x = x * p
    x.sum().backward()
    reducer.finish_backward()
    assert len(layout.buckets) == 10
    assert storage.buffer_bytes() <= storage.max_buffers * 4 * 4
    assert storage.shard.tolist() == [1.0] * 40
