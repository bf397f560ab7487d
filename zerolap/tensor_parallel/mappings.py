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

Every collective goes through ``zerolap.comm``, so the comms logger and the profiler see it.
The all-reduces run in place on a fresh tensor: an autograd Function's input may be saved by
the operation that produced it.
"""

from __future__ import annotations

import torch

import zerolap.comm as dist

__all__ = [
    "all_reduce_",
    "copy_to_region",
    "gather_from_region",
    "gather_last_dim",
    "reduce_from_region",
    "scatter_to_region",
    "split_last_dim",
]


def all_reduce_(tensor: torch.Tensor, group, *, async_op: bool = False):
    """Sum ``tensor`` in place over ``group`` (a handle when ``async_op``)."""
    return dist.all_reduce(tensor, group=group, async_op=async_op)


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
        grad = grad.clone()
        all_reduce_(grad, ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        all_reduce_(out, group)
        return out

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
