"""The ring all-reduce and its phases: exact results, any length and dtype, and the bytes each
rank sends against 2K(N-1)/N."""

from __future__ import annotations

import time

import pytest
import torch

import zerolap.comm as dist
from tests.comm.expected import reductions
from zerolap.comm.chunking import even_chunks

LENGTHS = [1, 3, 8, 1001, 4096]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]


def _contribution(numel: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    # Small integers keep every sum exact in half precision too.
    return ((torch.arange(numel) % 7) * (rank + 1)).to(dtype)


def check_ring_all_reduce_exact():
    rank, n = dist.get_rank(), dist.get_world_size()
    factor = sum(range(1, n + 1))
    for dtype in DTYPES:
        for numel in LENGTHS:
            tensor = _contribution(numel, rank, dtype)
            out = dist.ring_all_reduce(tensor)
            assert out is tensor
            want = ((torch.arange(numel) % 7) * factor).to(dtype)
            assert torch.equal(tensor, want), (dtype, numel)


def check_ring_ops():
    rank, n = dist.get_rank(), dist.get_world_size()
    values = [float(r + 2) for r in range(n)]
    expected = reductions(values)
    for op, want in expected.items():
        tensor = torch.full((13,), values[rank], dtype=torch.float64)
        dist.ring_all_reduce(tensor, op=op)
        assert torch.allclose(tensor, torch.full((13,), want, dtype=torch.float64)), op


def check_ring_reduce_scatter_owns_chunk_r():
    rank, n = dist.get_rank(), dist.get_world_size()
    for numel in LENGTHS:
        tensor = _contribution(numel, rank, torch.float32)
        mine = dist.ring_reduce_scatter(tensor)
        start, end = even_chunks(numel, n)[rank]
        want = ((torch.arange(numel) % 7) * sum(range(1, n + 1))).float()[start:end]
        assert mine.data_ptr() == tensor[start:end].data_ptr() or mine.numel() == 0
        assert torch.equal(mine, want), numel


def check_ring_all_gather_fills_from_owners():
    rank, n = dist.get_rank(), dist.get_world_size()
    for numel in LENGTHS:
        tensor = torch.full((numel,), -1.0)
        bounds = even_chunks(numel, n)
        start, end = bounds[rank]
        tensor[start:end] = float(rank)
        dist.ring_all_gather(tensor)
        want = torch.cat([torch.full((e - s,), float(c)) for c, (s, e) in enumerate(bounds)])
        assert torch.equal(tensor, want), numel


def check_ring_wire_bytes(numel: int):
    """Returns the bytes this rank sent in each phase, read from the comms logger."""
    rank = dist.get_rank()
    dist.configure(enabled=True, prof_all=True)
    dist.reset_log()
    try:
        tensor = _contribution(numel, rank, torch.float32)
        dist.ring_reduce_scatter(tensor)
        dist.ring_all_gather(tensor)
        dist.ring_all_reduce(_contribution(numel, rank, torch.float32))
        return [r.wire_bytes for r in dist.COMMS_LOGGER.records]
    finally:
        dist.configure(enabled=False)
        dist.reset_log()


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "check",
    [
        check_ring_all_reduce_exact,
        check_ring_ops,
        check_ring_reduce_scatter_owns_chunk_r,
        check_ring_all_gather_fills_from_owners,
    ],
    ids=lambda f: f.__name__.removeprefix("check_"),
)
def test_ring(ranks, world_size, check):
    ranks(world_size).run(check)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_traffic_is_2k_n_minus_1_over_n(ranks, world_size):
    numel = 1024 * world_size  # divisible: every rank sends exactly K(N-1)/N per phase
    per_rank = ranks(world_size).run(check_ring_wire_bytes, numel)
    phase = numel * (world_size - 1) // world_size * 4
    for sent in per_rank:
        assert sent == [phase, phase, 2 * phase]


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_traffic_uneven_length(ranks, world_size):
    numel = 1001
    per_rank = ranks(world_size).run(check_ring_wire_bytes, numel)
    sizes = [e - s for s, e in even_chunks(numel, world_size)]
    for rank, (rs, ag, ar) in enumerate(per_rank):
        # Each phase sends every chunk but one: reduce-scatter skips the rank's own chunk, the
        # all-gather skips the chunk of its right neighbour.
        assert rs == (numel - sizes[rank]) * 4
        assert ag == (numel - sizes[(rank + 1) % world_size]) * 4
        assert ar == rs + ag
    # Over all ranks: exactly K(N-1) elements per phase.
    assert sum(rs for rs, _, _ in per_rank) == numel * (world_size - 1) * 4


def check_async_ring_runs_in_background():
    rank, n = dist.get_rank(), dist.get_world_size()
    tensor = torch.full((1 << 20,), float(rank))
    handle = dist.ring_all_reduce(tensor, async_op=True)
    deadline = time.monotonic() + 30
    while not handle.is_completed():  # completes with no wait(): the worker thread drives it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    handle.wait()
    assert handle.value is tensor
    assert torch.equal(tensor, torch.full((1 << 20,), float(sum(range(n)))))
    mine = dist.ring_reduce_scatter(torch.ones(10), async_op=True)
    mine.wait()
    assert torch.equal(mine.value, torch.full((mine.value.numel(),), float(n)))


def test_async_ring_runs_in_background(ranks):
    ranks(2).run(check_async_ring_runs_in_background)
