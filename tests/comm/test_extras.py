"""The rest of ``deepspeed.comm``: all-to-all, gather/scatter, object collectives, barriers,
coalesced ops and group helpers, on 2 and 4 gloo ranks with exact expected values, named errors
before anything moves, and their comms-log records."""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass

import pytest
import torch

import zerolap.comm as dist
from tests.comm.test_errors import _group_still_works, _raises
from zerolap.comm.logger import COMMS_LOGGER

WORLD_SIZES = [2, 4]


@dataclass(frozen=True)
class Point:
    x: int
    label: str


def _splits(n: int) -> list[list[int]]:
    """Rows rank r sends to rank j: uneven, some zero."""
    return [[(r + 2 * j) % 3 for j in range(n)] for r in range(n)]


def _a2a_input(rank: int, splits: list[list[int]]) -> torch.Tensor:
    """Rank r's rows for rank j hold 100 r + j, then 100 r + j + 0.5 (two columns)."""
    rows = [
        torch.tensor([[100.0 * rank + j, 100.0 * rank + j + 0.5]] * count)
        for j, count in enumerate(splits[rank])
    ]
    return torch.cat(rows).reshape(-1, 2)


def _tail_group() -> tuple[object, list[int]]:
    """Every rank but 0 (the whole job on 2 ranks): a group whose last rank is a non-zero root."""
    n = dist.get_world_size()
    members = list(range(1, n)) if n > 2 else list(range(n))
    return dist.new_group(members), members


def check_all_to_all_single():
    rank, n = dist.get_rank(), dist.get_world_size()
    # Even split: row j of rank r goes to rank j.
    out = torch.empty(n, dtype=torch.int64)
    dist.all_to_all_single(out, torch.arange(n) + 10 * rank)
    assert out.tolist() == [10 * r + rank for r in range(n)]
    # Uneven split sizes, 2-column rows, async.
    splits = _splits(n)
    tensor = _a2a_input(rank, splits)
    receives = [splits[j][rank] for j in range(n)]
    output = torch.full((sum(receives), 2), -1.0)
    handle = dist.all_to_all_single(output, tensor, receives, splits[rank], async_op=True)
    assert isinstance(handle, dist.Handle)
    handle.wait()
    want = torch.cat(
        [torch.tensor([[100.0 * j + rank, 100.0 * j + rank + 0.5]] * receives[j]) for j in range(n)]
    ).reshape(-1, 2)
    assert torch.equal(output, want), (output, want)
    # Within a sub-group: group ranks, not global ranks, index the splits.
    group, members = _tail_group()
    if rank in members:
        m, me = len(members), members.index(rank)
        out = torch.empty(m)
        dist.all_to_all_single(out, torch.arange(m, dtype=torch.float32) + 10 * me, group=group)
        assert out.tolist() == [10.0 * g + me for g in range(m)]


def check_all_to_all_lists():
    rank, n = dist.get_rank(), dist.get_world_size()
    inputs = [torch.full((rank + j + 1,), 10 * rank + j) for j in range(n)]
    outputs = [torch.empty(j + rank + 1, dtype=torch.int64) for j in range(n)]
    dist.all_to_all(outputs, inputs)
    assert [o.tolist() for o in outputs] == [[10 * j + rank] * (j + rank + 1) for j in range(n)]


def check_gather_and_scatter():
    rank, n = dist.get_rank(), dist.get_world_size()
    for dst in range(n):
        pieces = [torch.empty(3) for _ in range(n)] if rank == dst else None
        dist.gather(torch.full((3,), float(rank)), pieces, dst=dst)
        if rank == dst:
            assert [p.tolist() for p in pieces] == [[float(r)] * 3 for r in range(n)]
    src = n - 1
    tensor = torch.zeros(2, dtype=torch.int32)
    handle = dist.scatter(
        tensor,
        [torch.full((2,), 10 * i, dtype=torch.int32) for i in range(n)] if rank == src else None,
        src=src,
        async_op=True,
    )
    handle.wait()
    assert tensor.tolist() == [10 * rank] * 2
    # A sub-group with a non-zero root, named by its global rank.
    group, members = _tail_group()
    root = members[-1]
    if rank in members:
        me = members.index(rank)
        pieces = [torch.empty(2) for _ in members] if rank == root else []
        dist.gather(
            torch.full((2,), float(rank)), pieces, dst=root, group=group, async_op=True
        ).wait()
        if rank == root:
            assert [p[0].item() for p in pieces] == [float(r) for r in members]
        out = torch.empty(1)
        scatter_list = [torch.tensor([float(g * g)]) for g in range(len(members))]
        dist.scatter(out, scatter_list if rank == root else None, src=root, group=group)
        assert out.item() == float(me * me)


def _object_for(rank: int) -> dict:
    """A different object per rank, of different pickled sizes."""
    return {
        "rank": rank,
        "text": "x" * (37 * rank),
        "point": Point(rank, f"p{rank}"),
        "nested": [(rank, None), {rank, rank + 1}, 2.5 * rank],
    }


def check_object_collectives():
    rank, n = dist.get_rank(), dist.get_world_size()
    src = n - 1
    sent = [{"a": 1, "b": [1, 2, 3]}, "text", (4, 5.5), None, Point(7, "seven"), torch.arange(3)]
    objects = list(sent) if rank == src else [None] * len(sent)
    dist.broadcast_object_list(objects, src=src)
    assert objects[:5] == sent[:5] and torch.equal(objects[5], sent[5])
    gathered = [None] * n
    dist.all_gather_object(gathered, _object_for(rank))
    assert gathered == [_object_for(r) for r in range(n)]
    for dst in (0, n - 1):
        out = [None] * n if rank == dst else None
        dist.gather_object(_object_for(rank), out, dst=dst)
        if rank == dst:
            assert out == [_object_for(r) for r in range(n)]
    group, members = _tail_group()
    if rank in members:
        root = members[-1]
        out = [None] * len(members)
        dist.all_gather_object(out, Point(rank, "g"), group=group)
        assert out == [Point(r, "g") for r in members]
        objects = ["from root", rank] if rank == root else [None, None]
        dist.broadcast_object_list(objects, src=root, group=group)
        assert objects == ["from root", root]
        out = [None] * len(members) if rank == root else None
        dist.gather_object(str(rank) * rank, out, dst=root, group=group)
        if rank == root:
            assert out == [str(r) * r for r in members]


def check_barriers_and_group_helpers():
    rank, n = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    dist.barrier(async_op=True).wait()
    dist.monitored_barrier()
    dist.monitored_barrier(timeout=30, wait_all_ranks=True)
    world = dist.get_world_group()
    assert world is torch.distributed.group.WORLD
    t = torch.ones(2)
    dist.all_reduce(t, group=world)
    assert t.tolist() == [float(n)] * 2
    assert dist.get_all_ranks_from_group() == list(range(n))
    assert dist.get_all_ranks_from_group(world) == list(range(n))
    group, members = _tail_group()
    if rank in members:
        assert dist.get_all_ranks_from_group(group) == members
        assert dist.get_global_rank(group, len(members) - 1) == members[-1]
        dist.monitored_barrier(group)
    assert dist.get_global_rank() == 0
    assert dist.is_available()


def check_coalesced_and_aliases():
    rank, n = dist.get_rank(), dist.get_world_size()
    total = float(sum(range(n)))
    tensors = [torch.full((3,), float(rank)), torch.full((2, 2), float(rank + 1))]
    dist.all_reduce_coalesced(tensors)
    assert tensors[0].tolist() == [total] * 3
    assert tensors[1].tolist() == [[total + n] * 2] * 2
    tensors = [torch.full((2,), float(rank)), torch.full((1,), 1.0)]
    dist.all_reduce_coalesced(tensors, op="avg", async_op=True).wait()
    assert tensors[0].tolist() == [total / n] * 2 and tensors[1].tolist() == [1.0]
    inputs = [torch.full((2,), rank, dtype=torch.int64), torch.full((1, 3), -rank)]
    outputs = [torch.empty(2 * n, dtype=torch.int64), torch.empty(n, 3, dtype=torch.int64)]
    dist.all_gather_coalesced(outputs, inputs)
    assert outputs[0].tolist() == [r for r in range(n) for _ in range(2)]
    assert outputs[1].tolist() == [[-r] * 3 for r in range(n)]
    t = torch.full((4,), float(rank))
    dist.inference_all_reduce(t)
    assert t.tolist() == [total] * 4
    flat = torch.empty(2 * n)
    dist.allgather_fn(flat, torch.full((2,), float(rank)), async_op=True).wait()
    assert flat.tolist() == [float(r) for r in range(n) for _ in range(2)]
    out = torch.empty(2)
    dist.reduce_scatter_fn(out, torch.arange(2.0 * n) + rank)
    assert out.tolist() == [n * (2.0 * rank + i) + total for i in range(2)]
    assert dist.has_all_gather_into_tensor() and dist.has_reduce_scatter_tensor()
    assert dist.has_all_reduce_coalesced()


def check_torch_backend() -> None:
    """DeepSpeed's backend object: torch's raw tensor collectives from the class (what
    DeepSpeed's communication benchmark times), zerolap.comm's operations from an instance."""
    rank, n = dist.get_rank(), dist.get_world_size()
    raw = torch.empty(n)
    dist.TorchBackend.get_all_gather_function()(raw, torch.tensor([float(rank)]))
    assert raw.tolist() == [float(r) for r in range(n)]
    out = torch.empty(1)
    dist.TorchBackend.get_reduce_scatter_function()(out, torch.ones(n))
    assert out.item() == n
    backend = dist.TorchBackend("gloo")  # joined already: kept
    t = torch.tensor([float(rank)])
    COMMS_LOGGER.reset()
    dist.configure(enabled=True, prof_all=True)
    backend.all_reduce(t)
    dist.configure(enabled=False)
    assert t.item() == n * (n - 1) / 2
    assert [r.name for r in COMMS_LOGGER.records] == ["all_reduce"]
    assert backend.get_world_size() == n and backend.name == "torch"
    with pytest.raises(AttributeError, match="TorchBackend has no operation 'all_reduce_bogus'"):
        backend.all_reduce_bogus(t)


CHECKS = [
    check_all_to_all_single,
    check_all_to_all_lists,
    check_gather_and_scatter,
    check_object_collectives,
    check_barriers_and_group_helpers,
    check_coalesced_and_aliases,
    check_torch_backend,
]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_extra_op(ranks, world_size, check):
    ranks(world_size).run(check)


def check_bad_input_is_named():
    rank, n = dist.get_rank(), dist.get_world_size()
    members = list(range(n))
    a2a = dist.all_to_all_single
    lopsided = [0] * n  # receives every row from the next rank, none from itself
    lopsided[(rank + 1) % n] = n
    cases = [
        (
            ValueError,
            f"input_split_sizes has 1 entries but the group has {n} ranks",
            a2a,
            (torch.empty(n), torch.empty(n), None, [n]),
        ),
        (
            ValueError,
            f"input_split_sizes={[1] * (n - 1) + [2]} sums to {n + 1} rows but tensor "
            f"has {n} rows (dim 0)",
            a2a,
            (torch.empty(n), torch.empty(n), None, [1] * (n - 1) + [2]),
        ),
        (
            ValueError,
            f"output_split_sizes={[0] * n} sums to 0 rows but output has {n} rows",
            a2a,
            (torch.empty(n), torch.empty(n), [0] * n),
        ),
        (
            ValueError,
            f"tensor has {n + 1} rows (dim 0), which do not split evenly over {n} ranks",
            a2a,
            (torch.empty(n + 1), torch.empty(n + 1)),
        ),
        (
            ValueError,
            "has a negative size",
            a2a,
            (torch.empty(n), torch.empty(n), None, [-1] + [1] * (n - 2) + [2]),
        ),
        (
            ValueError,
            f"output rows (shape ({n}, 3)) hold 3 elements but tensor rows (shape ({n}, 2)) hold 2",
            a2a,
            (torch.empty(n, 3), torch.empty(n, 2)),
        ),
        (
            TypeError,
            "output is torch.float64 but tensor is torch.float32",
            a2a,
            (torch.empty(n, dtype=torch.float64), torch.empty(n)),
        ),
        (ValueError, "tensor is a 0-dim tensor", a2a, (torch.empty(n), torch.tensor(1.0))),
        (
            ValueError,
            f"sends itself input_split_sizes[{rank}]=1 rows but expects "
            f"output_split_sizes[{rank}]=0 from itself",
            a2a,
            (torch.empty(n), torch.empty(n), lopsided),
        ),
        (
            ValueError,
            f"input_tensor_list has 1 entries but the group has {n} ranks",
            dist.all_to_all,
            ([torch.empty(1)] * n, [torch.empty(1)]),
        ),
        (
            ValueError,
            f"dst={n} is not a member of group ranks {members}",
            dist.gather,
            (torch.empty(1), None, n),
        ),
        (
            ValueError,
            f"src=-1 is not a member of group ranks {members}",
            dist.scatter,
            (torch.empty(1), None, -1),
        ),
        (
            ValueError,
            f"gather_list has 1 tensors but the group has {n} ranks",
            dist.gather,
            (torch.empty(2), [torch.empty(2)], rank),
        ),
        (
            ValueError,
            "gather_list[0] has 3 elements of torch.float32, expected 2 of torch.float32",
            dist.gather,
            (torch.empty(2), [torch.empty(3)] * n, rank),
        ),
        (
            ValueError,
            f"this rank is the src (src={rank}) and must pass scatter_list",
            dist.scatter,
            (torch.empty(2), None, rank),
        ),
        (
            ValueError,
            f"scatter_list is given on rank {rank}, which is not the src",
            dist.scatter,
            (torch.empty(2), [torch.empty(2)] * n, (rank + 1) % n),
        ),
        (
            ValueError,
            f"object_list has 1 entries but the group has {n} ranks",
            dist.all_gather_object,
            ([None], "obj"),
        ),
        (
            TypeError,
            "object_list must be a list, got tuple",
            dist.all_gather_object,
            ((None,) * n, "obj"),
        ),
        (ValueError, f"src={n} is not a member", dist.broadcast_object_list, ([1], n)),
        (
            ValueError,
            f"object_gather_list has {n + 1} entries but the group has {n} ranks",
            dist.gather_object,
            ("obj", [None] * (n + 1), rank),
        ),
        (
            TypeError,
            "tensors[1] is torch.float64 but tensors[0] is torch.float32",
            dist.all_reduce_coalesced,
            ([torch.ones(1), torch.ones(1, dtype=torch.float64)],),
        ),
        (
            ValueError,
            f"output_tensors[0] has 3 elements but must have world_size x "
            f"input_tensors[0] = {n} x 2",
            dist.all_gather_coalesced,
            ([torch.empty(3)], [torch.empty(2)]),
        ),
        (
            ValueError,
            f"group_rank={n} is outside group ranks 0..{n - 1}",
            dist.get_global_rank,
            (None, n),
        ),
    ]
    for exc_type, fragment, fn, args in cases:
        _raises(exc_type, fragment, fn, *args)
        _group_still_works()
    # A rank outside a sub-group.
    group = dist.new_group([0])
    if rank != 0:
        for fn, args in (
            (dist.gather, (torch.empty(1),)),
            (dist.all_to_all_single, (torch.empty(1), torch.empty(1))),
            (dist.all_gather_object, ([None], 1)),
            (dist.monitored_barrier, ()),
        ):
            _raises(
                ValueError,
                f"rank {rank} is not a member of group ranks [0]",
                fn,
                *args,
                group=group,
            )
    _group_still_works()
    # A list length only src knows: the others receive, keep their list, and say so.
    src = n - 1
    mine = ["a", "b", "c"] if rank == src else ["kept"]
    if rank == src:
        dist.broadcast_object_list(mine, src=src)
    else:
        _raises(
            ValueError,
            f"object_list has 1 entries on rank {rank} but src={src} sent 3",
            dist.broadcast_object_list,
            mine,
            src,
        )
        assert mine == ["kept"]
    _group_still_works()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bad_input_is_named_and_group_survives(ranks, world_size):
    ranks(world_size).run(check_bad_input_is_named)


def _pickled(obj: object) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def check_logged_extras():
    rank, n = dist.get_rank(), dist.get_world_size()
    dist.configure(enabled=True, prof_all=True)
    dist.reset_log()
    assert not dist.has_comm_data()
    try:
        splits = _splits(n)
        tensor = _a2a_input(rank, splits)
        receives = [splits[j][rank] for j in range(n)]
        dist.all_to_all_single(torch.empty(sum(receives), 2), tensor, receives, splits[rank])
        root = n - 1
        pieces = [torch.empty(8) for _ in range(n)] if rank == root else None
        dist.gather(torch.ones(8), pieces, dst=root)
        dist.scatter(torch.empty(8), [torch.ones(8)] * n if rank == root else None, src=root)
        dist.all_gather_object([None] * n, _object_for(rank))
        sent = ["abc", {"k": 1}] if rank == root else [None, None]
        dist.broadcast_object_list(sent, src=root)
        dist.gather_object(_object_for(rank), [None] * n if rank == root else None, dst=root)
        dist.all_reduce_coalesced([torch.ones(3), torch.ones(5)])
        dist.monitored_barrier()
        dist.barrier()
        records = {r.op: r for r in COMMS_LOGGER.records}
        row_bytes = 2 * 4
        a2a = records["all_to_all_single"]
        assert a2a.message_bytes == tensor.numel() * 4
        assert a2a.wire_bytes == row_bytes * (sum(splits[rank]) - splits[rank][rank])
        assert records["gather"].message_bytes == 32 * n
        assert records["gather"].wire_bytes == (0 if rank == root else 32)
        assert records["scatter"].message_bytes == 32 * n
        assert records["scatter"].wire_bytes == (32 * (n - 1) if rank == root else 0)
        sizes = [_pickled(_object_for(r)) for r in range(n)]
        ago = records["all_gather_object"]
        assert ago.message_bytes == sum(sizes)
        assert ago.wire_bytes == (n - 1) * (max(sizes) + 8)  # padded pieces and the sizes
        bol = records["broadcast_object_list"]
        assert bol.message_bytes == _pickled(["abc", {"k": 1}])
        tail = rank == (root - 1) % n  # the broadcast chain's last rank sends nothing
        assert bol.wire_bytes == (0 if tail else bol.message_bytes + 16)
        assert records["gather_object"].message_bytes == sum(sizes)
        assert records["gather_object"].wire_bytes == 8 * (n - 1) + (
            0 if rank == root else max(sizes)
        )
        arc = records["all_reduce_coalesced"]
        assert arc.message_bytes == 32 and arc.wire_bytes == 2 * 32 * (n - 1) // n
        for op in ("monitored_barrier", "barrier"):
            assert (records[op].message_bytes, records[op].wire_bytes) == (0, 0)
        deadline = time.monotonic() + 10
        while dist.get_comm_operation_count() < len(COMMS_LOGGER.records):
            assert time.monotonic() < deadline, "a record never closed"
            time.sleep(0.01)
        assert dist.has_comm_data() and dist.get_comm_operation_count() == 9
        assert dist.get_logged_comm_ops() == list(records)
        summary = dist.log_summary()
        assert summary["all_gather_object"][sum(sizes)]["count"] == 1
    finally:
        dist.configure(enabled=False)
        dist.reset_log()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_extras_are_logged_with_their_bytes(ranks, world_size):
    ranks(world_size).run(check_logged_extras)


def check_monitored_barrier_names_the_missing_rank():
    rank, n = dist.get_rank(), dist.get_world_size()
    # A group of its own: a timed-out monitored barrier leaves its group's connections broken.
    group = dist.new_group([0, n - 1])
    result = None
    if rank == 0:  # group rank 0 watches; rank n - 1 never arrives
        start = time.monotonic()
        try:
            dist.monitored_barrier(group, timeout=0.5)
        except dist.CommError as err:
            result = str(err), time.monotonic() - start
        else:
            raise AssertionError("monitored_barrier without its peer did not time out")
    _group_still_works()
    return result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_monitored_barrier_names_the_missing_rank(ranks, world_size):
    message, elapsed = ranks(world_size).run(check_monitored_barrier_names_the_missing_rank)[0]
    assert (
        f"rank 0 waited for monitored_barrier on group ranks [0, {world_size - 1}] (gloo)"
        in message
    )
    assert "Rank 1 failed to pass monitoredBarrier in 500 ms" in message
    assert elapsed < 5


def test_wire_bytes_and_bus_factors_of_the_extra_ops():
    from zerolap.comm.volume import base_op, bus_factor, ring_wire_bytes

    # gather to group rank 2 of 4: every other rank sends its piece (a quarter of the message).
    assert [ring_wire_bytes("gather", 400, 4, group_rank=r, root=2) for r in range(4)] == [
        100,
        100,
        0,
        100,
    ]
    # scatter from group rank 1: the root sends every piece but its own.
    assert [ring_wire_bytes("scatter", 400, 4, group_rank=r, root=1) for r in range(4)] == [
        0,
        300,
        0,
        0,
    ]
    assert ring_wire_bytes("all_to_all_single", 400, 4) == 300
    assert ring_wire_bytes("all_reduce_coalesced", 400, 4) == 600
    assert ring_wire_bytes("monitored_barrier", 0, 4) == 0
    for op in ("all_to_all_single", "gather", "scatter", "gather_object"):
        assert bus_factor(op, 4) == pytest.approx(0.75)
    assert base_op("all_gather_object") == "all_gather"
    assert base_op("broadcast_object_list") == "broadcast"
    assert base_op("reduce_scatter_tensor") == "reduce_scatter"
