"""Bad input fails before any communication, names what is wrong, and leaves the group usable."""

from __future__ import annotations

import pytest
import torch

import zerolap.comm as dist
from tests.multiproc import run_on_ranks
from zerolap.comm.checks import GroupInfo, check_tensor


def _raises(exc_type, fragment: str, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except exc_type as err:
        assert fragment in str(err), f"{fragment!r} not in {err!r}"
        return
    raise AssertionError(f"{fn.__name__} did not raise {exc_type.__name__}({fragment!r})")


def _group_still_works() -> None:
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(dist.get_world_size())))


def check_every_bad_input_is_named():
    n = dist.get_world_size()
    cases = [
        # (exception, fragment, fn, args, kwargs)
        (
            ValueError,
            f"input has 7 elements but must have world_size x output = {n} x 3",
            dist.reduce_scatter_tensor,
            (torch.zeros(3), torch.zeros(7)),
            {},
        ),
        (
            ValueError,
            f"input has {n + 1} tensors but the group has {n} ranks",
            dist.reduce_scatter,
            (torch.zeros(3), [torch.zeros(3)] * (n + 1)),
            {},
        ),
        (
            ValueError,
            "input[1] has 4 elements of torch.float32, expected 3",
            dist.reduce_scatter,
            (torch.zeros(3), [torch.zeros(3), torch.zeros(4)] + [torch.zeros(3)] * (n - 2)),
            {},
        ),
        (
            ValueError,
            f"output_tensor has 5 elements but must have world_size x input_tensor = {n} x 2",
            dist.all_gather_into_tensor,
            (torch.zeros(5), torch.zeros(2)),
            {},
        ),
        (
            ValueError,
            f"tensor_list has 1 tensors but the group has {n} ranks",
            dist.all_gather,
            ([torch.zeros(2)], torch.zeros(2)),
            {},
        ),
        (
            TypeError,
            "output_tensor is torch.float64 but input_tensor is torch.float32",
            dist.all_gather_into_tensor,
            (torch.zeros(2 * n, dtype=torch.float64), torch.zeros(2)),
            {},
        ),
        (
            ValueError,
            f"src={n} is not a member of group ranks {list(range(n))}",
            dist.broadcast,
            (torch.zeros(2), n),
            {},
        ),
        (ValueError, "dst=-1 is not a member", dist.reduce, (torch.zeros(2), -1), {}),
        (ValueError, "is this rank itself", dist.isend, (torch.zeros(2), dist.get_rank()), {}),
        (
            ValueError,
            "unknown reduction op 'median'",
            dist.all_reduce,
            (torch.zeros(2), "median"),
            {},
        ),
        (
            TypeError,
            "op 'avg' needs a floating-point tensor, got dtype torch.int64",
            dist.all_reduce,
            (torch.zeros(2, dtype=torch.int64), "avg"),
            {},
        ),
        (ValueError, "is not contiguous", dist.all_reduce, (torch.zeros(4, 4).t(),), {}),
        (TypeError, "tensor must be a torch.Tensor, got list", dist.all_reduce, ([1.0],), {}),
        (ValueError, f"ranks [{n}] are outside the job's ranks", dist.new_group, ([0, n],), {}),
    ]
    for exc_type, fragment, fn, args, kwargs in cases:
        _raises(exc_type, fragment, fn, *args, **kwargs)
        _group_still_works()
    # A rank outside a sub-group calling a collective on it.
    group = dist.new_group([0])
    if dist.get_rank() != 0:
        _raises(
            ValueError,
            f"rank {dist.get_rank()} is not a member of group ranks [0]",
            dist.all_reduce,
            torch.zeros(1),
            group=group,
        )
    _group_still_works()


@pytest.mark.parametrize("world_size", [2, 4])
def test_bad_input_is_named_and_group_survives(ranks, world_size):
    ranks(world_size).run(check_every_bad_input_is_named)


def test_cpu_tensor_on_nccl_group_is_rejected():
    info = object.__new__(GroupInfo)
    info.backend, info.ranks, info.size, info.rank, info.group = "nccl", [0, 1], 2, 0, None
    with pytest.raises(ValueError, match="is on cpu but the group's backend is nccl"):
        check_tensor("all_reduce", "tensor", torch.zeros(2), info)


def op_before_init():
    for call in (
        lambda: dist.all_reduce(torch.zeros(1)),
        lambda: dist.get_rank(),
        lambda: dist.barrier(),
        lambda: dist.ring_all_reduce(torch.zeros(2)),
    ):
        _raises(RuntimeError, "call zerolap.comm.init_distributed() first", call)


def test_op_before_init_distributed_says_to_call_it():
    run_on_ranks(op_before_init, 1, init=False, timeout=60)


# -- debug mode: every collective's call compared across the group --------------------------------


def mismatched_calls() -> list[str]:
    """Each case would return a wrong result or abort in C++ without the debug mode; with it,
    every rank raises naming what each rank called, and the group still works after."""
    rank = dist.get_rank()
    cases = [
        lambda: dist.all_reduce(torch.ones(4), op="sum" if rank == 0 else "max"),
        lambda: dist.broadcast(torch.zeros(4 if rank == 0 else 6), src=0),
        lambda: dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.int64)),
        lambda: dist.all_reduce(torch.ones(4)) if rank == 0 else dist.broadcast(torch.ones(4), 0),
        lambda: dist.broadcast_object_list([1], src=0) if rank == 0 else dist.barrier(),
        lambda: (
            dist.ring_all_reduce(torch.ones(8))
            if rank == 0
            else dist.ring_all_gather(torch.ones(8))
        ),
    ]
    messages = []
    for case in cases:
        try:
            case()
        except dist.CollectiveMismatch as err:
            messages.append(str(err))
        else:
            messages.append("no error")
        _group_still_works()
    return messages


def test_debug_mode_names_mismatched_collectives():
    first, second = run_on_ranks(
        mismatched_calls, 2, env={"ZEROLAP_DEBUG_COLLECTIVES": "1"}, timeout=60
    )
    assert first == second
    head = "collective mismatch on group ranks [0, 1]: "
    assert first == [
        head
        + "rank 0 calls all_reduce(sum) of 4 float32; rank 1 calls all_reduce(max) of 4 float32",
        head + "rank 0 calls broadcast rooted at group rank 0 of 4 float32; "
        "rank 1 calls broadcast rooted at group rank 0 of 6 float32",
        head + "rank 0 calls all_reduce(sum) of 4 float32; rank 1 calls all_reduce(sum) of 4 int64",
        head + "rank 0 calls all_reduce(sum) of 4 float32; "
        "rank 1 calls broadcast rooted at group rank 0 of 4 float32",
        head + "rank 0 calls broadcast_object_list rooted at group rank 0; rank 1 calls barrier",
        head + "rank 0 calls ring_all_reduce(sum) of 8 float32; rank 1 calls ring_all_gather of 8 "
        "float32",
    ]


def matching_calls() -> list[float]:
    out = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(out, op="max")
    dist.broadcast(out, src=1)
    objects = [None, None]
    dist.all_gather_object(objects, dist.get_rank())
    return [out[0].item(), *objects]


def test_debug_mode_lets_matching_collectives_through():
    env = {"ZEROLAP_DEBUG_COLLECTIVES": "1"}
    assert run_on_ranks(matching_calls, 2, env=env, timeout=60) == [[2.0, 0, 1]] * 2
