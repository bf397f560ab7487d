"""How tensor parallelism talks: autograd Functions that each wrap one ``zerolap.comm``
collective on an explicit ``group`` (Megatron's "region" mappings).

A tensor-parallel layer's activations are either *replicated* (every rank of the tensor group
holds the same tensor) or *split* along the last dimension (rank t holds slice t). Moving
between the two, forward and backward are each other's transpose:

| Function                 | forward                     | backward                    |
|--------------------------|-----------------------------|-----------------------------|
| ``copy_to_region``       | identity                    | all-reduce (sum)            |
| ``reduce_from_region``   | all-reduce (sum)            | identity                    |
| ``gather_from_region``   | all-gather, concat last dim | keep own slice              |
| ``scatter_to_region``    | keep own slice              | all-gather, concat last dim |

Every collective goes through ``zerolap.comm``, so the comms logger and the profiler see it,
named by the pass it serves (``FORWARD`` or ``BACKWARD``) so that each gets its own figures and
timeline lane. Each is launched asynchronously and followed by ``lanes.switch()`` before the
wait: inside the forward overlap's lanes the other half of the micro-batch computes meanwhile;
outside them the switch does nothing and the wait follows at once. The all-reduces run in place
on a fresh tensor: an autograd Function's input may be saved by the operation that produced it.

``skipped_collectives()`` turns every one of them into a no-op, for one purpose only: measuring
the step a tensor-parallel run would take if its communication were free (the results are
wrong while it is on).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

import zerolap.comm as dist
from zerolap.comm import ReduceOp
from zerolap.tensor_parallel import lanes

__all__ = [
    "BACKWARD",
    "FORWARD",
    "KINDS",
    "all_reduce_",
    "all_reduce_now",
    "copy_to_region",
    "gather_from_region",
    "gather_last_dim",
    "reduce_from_region",
    "scatter_to_region",
    "skipped_collectives",
    "split_last_dim",
    "wait",
]

# The comms logger's names for the all-reduces of each pass.
FORWARD = "tp_forward_all_reduce"
BACKWARD = "tp_backward_all_reduce"
KINDS = (FORWARD, BACKWARD)

_skipping = False


@contextlib.contextmanager
def skipped_collectives() -> Iterator[None]:
    """Tensor-parallel all-reduces do nothing inside this block: a measurement of the step
    without them, whose results are wrong."""
    global _skipping
    _skipping, before = True, _skipping
    try:
        yield
    finally:
        _skipping = before


def all_reduce_(tensor: torch.Tensor, group, *, name: str, op=ReduceOp.SUM):
    """Start reducing ``tensor`` in place over ``group``, logged as ``name``; returns the
    handle to ``wait`` for (None when collectives are skipped)."""
    if _skipping:
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=True, log_name=name)


def wait(handle) -> None:
    """Block until ``handle`` (from ``all_reduce_``) is done."""
    if handle is not None:
        handle.wait()


def all_reduce_now(tensor: torch.Tensor, group, *, name: str, op=ReduceOp.SUM) -> torch.Tensor:
    """Reduce ``tensor`` in place, letting the other lane compute while it is on the wire."""
    handle = all_reduce_(tensor, group, name=name, op=op)
    lanes.switch()
    wait(handle)
    return tensor


def split_last_dim(tensor: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of ``tensor``'s last dimension (which the group size divides)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    width = tensor.shape[-1]
    if width % size:
        raise ValueError(
            f"tensor parallelism: last dimension {width} is not divisible by the {size} ranks "
            "of the tensor group"
        )
    step = width // size
    return tensor[..., rank * step : (rank + 1) * step].contiguous()


def gather_last_dim(tensor: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the last dimension, in group-rank order."""
    pieces = dist.all_gather(tensor.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_now(grad.clone(), ctx.group, name=BACKWARD), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_now(x.clone(), group, name=FORWARD)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_last_dim(grad, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_last_dim(grad, ctx.group), None


def copy_to_region(x: torch.Tensor, group) -> torch.Tensor:
    """Replicated input entering split computation: identity, gradients summed over ranks."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group) -> torch.Tensor:
    """Partial sums leaving split computation: summed over ranks, gradient passed through."""
    return _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group) -> torch.Tensor:
    """Split last dimension made whole on every rank."""
    return _GatherFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group) -> torch.Tensor:
    """Replicated tensor cut to this rank's slice of the last dimension."""
    return _ScatterToRegion.apply(x, group)
