"""Collectives that carry gradients, for model code that moves activations between ranks:
expert parallelism's token buffers (``zerolap.moe``) and sequence parallelism's heads and
sequence pieces (``zerolap.sequence_parallel``).

``all_to_all``: rows of the input (dim 0) are cut evenly among the group's ranks, block j to
group rank j; the output holds the blocks each rank sent this one, in group-rank order. Its
gradient is the same all-to-all of the output's gradient (each block goes back where it came
from).
"""

from __future__ import annotations

import torch

import zerolap.comm as dist

__all__ = ["all_to_all"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, tokens: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        tokens = tokens.contiguous()
        out = torch.empty_like(tokens)
        dist.all_to_all_single(out, tokens, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, _AllToAll.apply(ctx.group, grad)


def all_to_all(tokens: torch.Tensor, group) -> torch.Tensor:
    """``tokens``' rows exchanged over ``group`` (differentiable)."""
    return _AllToAll.apply(group, tokens)
