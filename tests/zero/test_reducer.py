"""The reducer's scope (an interleaved pipeline chunk's backward reduces only that chunk's
buckets), the layout's kinds it relies on, stage 2's pool of bucket buffers and its in-place
buffer, in one process with a recording reduction; and the engine naming a parameter that holds
the buckets back."""

from __future__ import annotations

import pytest
import torch

import zerolap
from tests.logs import captured_logs
from tests.zero.models import loss_fn, make_model, rank_batch
from zerolap.zero.grad_storage import ShardGradients
from zerolap.zero.layout import build_layout, coalesce, layout_from_groups
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


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_a_coalesced_bucket_lays_its_members_out_rank_by_rank(world_size):
    """Every element of every member lands once, and row r of the buffer is chunk r of each
    member in order: what one reduce-scatter hands rank r, and its shard holds."""
    layout = layout_from_groups([[5, 3], [4], [10, 2], [1], [7]], world_size=world_size)
    merged = coalesce(layout, 100)
    assert [b.slots for b in merged.buckets] == [(0, 1, 2, 3, 4, 5, 6)]
    bucket = merged.buckets[0]
    assert bucket.chunk_numel == layout.shard_numel and merged.shard_numel == layout.shard_numel
    flat = list(range(layout.numel))  # each element named by its flat offset
    buffer = [None] * bucket.numel
    for slot in layout.slots:
        for at, i, count in bucket.places(slot.offset, slot.numel):
            for k in range(count):
                assert buffer[at + k] is None
                buffer[at + k] = flat[slot.offset + i + k]
    row = bucket.chunk_numel
    for rank in range(world_size):
        want = [
            e if any(s.offset <= e < s.offset + s.numel for s in layout.slots) else None
            for member in layout.buckets
            for e in range(*member.chunk(rank))
        ]
        assert buffer[rank * row : (rank + 1) * row] == want
    # Runs of consecutive buckets up to the size (one larger than it alone), in order.
    for size in (1, 8, 13, 20):
        runs = coalesce(layout, size)
        assert [p for b in runs.buckets for p in b.parts()] == list(layout.buckets)
        for run in runs.buckets:  # its parts keep their own indices (offload is told them)
            assert run.numel <= size or len(run.parts()) == 1
        for slot, merged_slot in zip(layout.slots, runs.slots, strict=True):
            assert merged_slot.offset == slot.offset
            assert layout.buckets[slot.bucket] in runs.buckets[merged_slot.bucket].parts()


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


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("overlap", [True, False])
def test_stage_2_holds_at_most_its_pool_of_bucket_buffers(overlap, batched):
    """Ten one-parameter buckets, gradients arriving in bucket order as the layout expects
    them: the storage never holds more than its pool of buffers, with or without
    ``overlap_comm`` (without it, ready buckets are reduced when the pool runs out, instead of
    every bucket keeping a buffer until the end of backward), and every gradient lands whole;
    so too with stage 3's batched writes (where making room for a completed bucket, which
    reduces the ready ones without ``overlap_comm``, must not reduce it before its writes)."""
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(10)]
    layout = build_layout([4] * 10, bucket_numel=4, world_size=1)
    storage = ShardGradients(layout, 0, dtype=torch.float32, comm_dtype=torch.float32, device="cpu")
    reducer = GradReducer(params, layout, storage, _Recorded(), overlap=overlap, batched=batched)
    for _ in range(2):
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


def _reduce_rounds(batched: bool, dtype: torch.dtype, comm_dtype: torch.dtype, pre: float):
    """Four 3-element parameters in buckets (0, 1) and (2, 3), reduced by one backward made of
    three: the first reaches parameter 0, the second 0 and 1 (0's second gradient comes before
    its bucket is complete), the third 2 and 3 (bucket 1 completes while backward runs). What
    the storage then holds, and the buckets in the order they were launched."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, dtype=dtype)) for _ in range(4)]
    layout = build_layout([3] * 4, bucket_numel=6, world_size=1)
    storage = ShardGradients(
        layout, 0, dtype=torch.float32, comm_dtype=comm_dtype, device="cpu", pre=pre
    )
    reduction = _Recorded()
    reducer = GradReducer(params, layout, storage, reduction, overlap=True, batched=batched)
    reducer.begin_cycle()
    reducer.begin_backward(True)
    weights = [torch.randn(3, dtype=dtype) for _ in range(4)]
    (params[0] * weights[0]).sum().backward()
    if batched:  # held, not written: bucket 0 still waits for parameter 1
        assert storage._free == [] and reducer.buckets[0].buffer is None
    (params[0] * params[1] * weights[1]).sum().backward()
    (params[2] * weights[2] + params[3].square() * weights[3]).sum().backward()
    assert reduction.launched == [0, 1]
    reducer.finish_backward()
    return storage.shard.clone(), reduction.launched


@pytest.mark.parametrize(
    ("dtype", "comm_dtype", "pre"),
    [
        (torch.float32, torch.float32, 1.0),
        (torch.float32, torch.float32, 1 / 3),
        (torch.bfloat16, torch.bfloat16, 1 / 3),
        (torch.bfloat16, torch.float32, 1 / 3),
    ],
)
def test_stage_3_batched_writes_equal_the_gradients_written_one_by_one(dtype, comm_dtype, pre):
    """``batched`` (stage 3, whose buckets are modules' units): a bucket's gradients are held
    until its last one comes and written together in one multi-tensor copy, a parameter's
    second gradient added after it; the storage then holds, bitwise, what writing each
    gradient as it comes gives, with or without a pre factor (in a 16-bit buffer multiplied
    one by one, as torch's multi-tensor multiply rounds it otherwise), 16-bit gradients
    into a buffer of their dtype or of fp32."""
    batched, launched = _reduce_rounds(True, dtype, comm_dtype, pre)
    one_by_one, launched_too = _reduce_rounds(False, dtype, comm_dtype, pre)
    assert launched == launched_too == [0, 1]
    assert torch.equal(batched, one_by_one)
    assert batched.abs().min() > 0


def test_stage_3_batched_writes_what_an_incomplete_bucket_holds_at_the_end_of_backward():
    """A bucket whose parameter got no gradient completes only at the end of backward: the
    gradients it holds are written then, the missing one's place zero, before it reduces."""
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
    layout = build_layout([2, 2], bucket_numel=4, world_size=1)
    storage = ShardGradients(layout, 0, dtype=torch.float32, comm_dtype=torch.float32, device="cpu")
    reducer = GradReducer(params, layout, storage, _Recorded(), overlap=True, batched=True)
    reducer.begin_cycle()
    reducer.begin_backward(True)
    (params[0] * 5).sum().backward()
    assert reducer.finish_backward() == [params[1]]
    assert storage.shard.tolist() == [5.0, 5.0, 0.0, 0.0]


def test_stage_2_in_place_holds_no_more_than_the_pool_would():
    """One buffer of every bucket (gradients in place) where the hooks' pool would hold as
    much: as many buffers as buckets, up to its size, each of the largest bucket's size."""

    def costs_no_memory(sizes: list[int], bucket_numel: int) -> bool:
        layout = build_layout(sizes, bucket_numel=bucket_numel, world_size=1)
        storage = ShardGradients(
            layout, 0, dtype=torch.float32, comm_dtype=torch.float32, device="cpu"
        )
        return storage.in_place_costs_no_memory()

    assert costs_no_memory([4] * 10, 100)  # one bucket
    assert costs_no_memory([4] * 4, 4)  # four buckets: the pool holds four
    assert not costs_no_memory([4] * 5, 4)  # five: the pool still four
    assert costs_no_memory([4, 4, 4, 4, 16], 4)  # four of 16 elements: 32 of 64


def test_stage_2_in_place_reduces_every_backward_into_the_shard():
    """Stage 2 in place: each backward starts its buckets' buffers from zeros and reduces
    them into the shard (a second backward in the cycle adds; a bucket it does not reach
    reduces zeros), with no hook per parameter; param.grad is each place in the buffers."""
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(3)]
    layout = build_layout([4] * 3, bucket_numel=8, world_size=1)
    assert [b.slots for b in layout.buckets] == [(0, 1), (2,)]
    storage = ShardGradients(layout, 0, dtype=torch.float32, comm_dtype=torch.float32, device="cpu")
    reduction = _Recorded()
    reducer = GradReducer(params, layout, storage, reduction, overlap=False, in_place=True)
    assert reducer._hooks == []
    reducer.begin_cycle()
    for scale in (1.0, 10.0):
        reducer.begin_backward(True)
        assert all(p.grad is not None and not p.grad.any() for p in params)
        (params[0] * scale + params[1] * 2 * scale + params[2] * 3).sum().backward()
        reducer.finish_backward()
        assert params[2].grad.tolist() == [3.0] * 4  # its place in bucket 1's buffer
    reducer.begin_backward(True)  # a third that reaches bucket 0 only
    (params[0] * 100).sum().backward()
    reducer.finish_backward()
    assert reduction.launched == [0, 1] * 3  # bucket 1 reduced zeros in the third
    storage.settle()
    assert storage.shard.tolist() == [111.0] * 4 + [22.0] * 4 + [6.0] * 4


@pytest.mark.parametrize("released", [False, True], ids=["whole", "released at stage 3"])
def test_a_bucket_waiting_for_a_gradient_holds_back_the_ones_after_it_and_says_so(released):
    """Buckets reduce in order on every rank. When the first in order waits for a gradient
    that backward never computes (an unused parameter), the complete ones after it keep
    their buffers past the pool's four, up to the whole gradient: the engine says which
    bucket waits and for what, once (a stage-3 parameter by its full shape, released or
    not); the reductions are still right."""
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(10)]
    params[0] = torch.nn.Parameter(torch.empty(0) if released else torch.ones(2, 2))
    if released:
        params[0].ds_shape = torch.Size([2, 2])
    layout = build_layout([4] * 10, bucket_numel=4, world_size=1)  # a bucket per parameter
    storage = ShardGradients(layout, 0, dtype=torch.float32, comm_dtype=torch.float32, device="cpu")
    reducer = GradReducer(params, layout, storage, _Recorded(), overlap=False)
    reducer.begin_cycle()
    with captured_logs() as logs:
        for _ in range(2):
            reducer.begin_backward(True)
            sum((p * i).sum() for i, p in enumerate(params[1:], 1)).backward()
            reducer.finish_backward()
            assert storage.buffer_bytes() == 10 * 4 * 4
    said = [m for m in logs if "bucket 0 still waits" in m]
    assert len(said) == 1 and "of shape (2, 2) while" in said[0], logs
    storage.settle()
    assert storage.shard.tolist() == [0.0] * 4 + [
        float(i * 2) for i in range(1, 10) for _ in range(4)
    ]


def held_back_said() -> list[str]:
    """Stage 2 with its hooks, a bucket per parameter or two, and the parameter backward
    reaches first in the layout unused: the warning names it."""
    engine, *_ = zerolap.initialize(
        model=make_model(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 10},
        },
    )
    tokens, targets = rank_batch(0, 2)
    with captured_logs() as logs:
        engine.backward(loss_fn(engine(tokens, use_sometimes=False), targets))
    engine.destroy()
    return [m for m in logs if "still waits" in m]


def test_the_held_back_warning_names_the_parameter(ranks):
    for said in ranks(2).run(held_back_said, timeout=60):
        assert len(said) == 1 and "'sometimes." in said[0], said
