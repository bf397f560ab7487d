"""Every collective on 2 and 4 real gloo processes, with exact expected values."""

from __future__ import annotations

import pytest
import torch

import zerolap.comm as dist
from tests.comm.expected import reductions

WORLD_SIZES = [2, 4]


def check_all_reduce_seed_example():
    # The seed notes' example: rank r holds arange(5) + r.
    rank, n = dist.get_rank(), dist.get_world_size()
    tensor = torch.arange(5, dtype=torch.float32) + rank
    dist.all_reduce(tensor)
    expected = n * torch.arange(5, dtype=torch.float32) + sum(range(n))
    assert torch.equal(tensor, expected), (tensor, expected)
    return tensor.tolist()


def check_all_reduce_ops():
    rank, n = dist.get_rank(), dist.get_world_size()
    values = [float(r + 1) for r in range(n)]
    expected = reductions(values)
    for name, want in expected.items():
        t = torch.full((3,), values[rank])
        dist.all_reduce(t, op=name)
        assert torch.equal(t, torch.full((3,), want)), (name, t, want)
    t = torch.full((2,), values[rank])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert t.tolist() == [float(n)] * 2
    ints = torch.tensor([rank, 2 * rank], dtype=torch.int64)
    dist.all_reduce(ints)
    assert ints.tolist() == [sum(range(n)), 2 * sum(range(n))]


def check_all_reduce_async_avg_divides_on_wait():
    rank, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((1000,), float(rank))
    handle = dist.all_reduce(t, op="avg", async_op=True)
    assert isinstance(handle, dist.Handle)
    handle.wait()
    assert handle.is_completed()
    handle.wait()  # second wait is a no-op: no second division
    assert torch.equal(t, torch.full((1000,), sum(range(n)) / n))


def check_all_gather_forms():
    rank, n = dist.get_rank(), dist.get_world_size()
    tensor = torch.full((5,), float(rank))
    gathered = dist.all_gather(tensor)
    assert [g.tolist() for g in gathered] == [[float(r)] * 5 for r in range(n)]
    out = [torch.empty(5) for _ in range(n)]
    assert dist.all_gather(out, tensor) is None
    assert [g.tolist() for g in out] == [[float(r)] * 5 for r in range(n)]
    handle = dist.all_gather(tensor, async_op=True)
    handle.wait()
    assert [g[0].item() for g in handle.value] == [float(r) for r in range(n)]
    flat = torch.empty(3 * n, dtype=torch.int32)
    dist.all_gather_into_tensor(flat, torch.full((3,), rank, dtype=torch.int32))
    assert flat.tolist() == [r for r in range(n) for _ in range(3)]


def check_reduce_leaves_others_unchanged():
    # The seed notes' example: rank r holds r + 1; dst gets the sum, the others keep theirs.
    rank, n = dist.get_rank(), dist.get_world_size()
    for dst in range(n):
        tensor = torch.full((5,), float(rank + 1))
        dist.reduce(tensor, dst=dst)
        want = float(sum(range(1, n + 1))) if rank == dst else float(rank + 1)
        assert torch.equal(tensor, torch.full((5,), want)), (dst, tensor)
    tensor = torch.full((4,), float(rank + 1))
    dist.reduce(tensor, dst=n - 1, op="avg", async_op=True).wait()
    want = sum(range(1, n + 1)) / n if rank == n - 1 else float(rank + 1)
    assert torch.equal(tensor, torch.full((4,), want))


def check_broadcast():
    rank, n = dist.get_rank(), dist.get_world_size()
    for src in range(n):
        tensor = torch.full((5,), float(rank))
        dist.broadcast(tensor, src=src)
        assert torch.equal(tensor, torch.full((5,), float(src)))


def check_reduce_scatter_forms():
    # The seed notes' example: 2 ranks, input of 8 filled with rank + 1, output of 4 holds 3.
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = torch.full((4 * n,), float(rank + 1))
    out = torch.zeros(4)
    dist.reduce_scatter(out, flat, op="sum")
    assert torch.equal(out, torch.full((4,), float(sum(range(1, n + 1)))))
    # Distinct values per chunk: rank r's chunk c holds 10 * c + r.
    pieces = [torch.full((3,), 10.0 * c + rank) for c in range(n)]
    out = torch.zeros(3)
    dist.reduce_scatter(out, pieces)
    assert torch.equal(out, torch.full((3,), 10.0 * rank * n + sum(range(n))))
    out = torch.zeros(3)
    dist.reduce_scatter_tensor(out, torch.cat(pieces), op="avg")
    assert torch.allclose(out, torch.full((3,), 10.0 * rank + sum(range(n)) / n))
    handle = dist.reduce_scatter_tensor(out, torch.cat(pieces), async_op=True)
    handle.wait()
    assert torch.equal(out, torch.full((3,), 10.0 * rank * n + sum(range(n))))


def check_point_to_point():
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    incoming = torch.empty(6)
    recv = dist.irecv(incoming, src=left)
    send = dist.isend(torch.full((6,), float(rank)), dst=right)
    send.wait()
    recv.wait()
    assert recv.is_completed() and torch.equal(incoming, torch.full((6,), float(left)))
    if rank == 0:
        dist.send(torch.arange(4.0), dst=1)
        dist.send(torch.ones(2), dst=1)
    elif rank == 1:
        buf = torch.empty(4)
        assert dist.recv(buf, src=0) == 0
        assert torch.equal(buf, torch.arange(4.0))
        anyone = torch.empty(2)
        assert dist.recv(anyone) == 0  # from any rank: the sender is returned
        assert torch.equal(anyone, torch.ones(2))


def check_new_group_and_barrier():
    rank, n = dist.get_rank(), dist.get_world_size()
    evens = [r for r in range(n) if r % 2 == 0]
    group = dist.new_group(evens)
    if rank in evens:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == float(sum(evens))
        assert dist.get_world_size(group) == len(evens)
        assert dist.get_rank(group) == evens.index(rank)
    dist.barrier()


CHECKS = [
    check_all_reduce_seed_example,
    check_all_reduce_ops,
    check_all_reduce_async_avg_divides_on_wait,
    check_all_gather_forms,
    check_reduce_leaves_others_unchanged,
    check_broadcast,
    check_reduce_scatter_forms,
    check_point_to_point,
    check_new_group_and_barrier,
]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_collective(ranks, world_size, check):
    ranks(world_size).run(check)


def test_all_reduce_seed_output_on_four_ranks(ranks):
    results = ranks(4).run(check_all_reduce_seed_example)
    assert results == [[6.0, 10.0, 14.0, 18.0, 22.0]] * 4
