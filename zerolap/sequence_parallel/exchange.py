"""How sequence parallelism talks.

Inside attention (Hugging Face's layouts): before it, each of the S ranks holds its piece of
the sequence for every head, ``[batch, heads, L, head_dim]``; ``to_heads`` trades pieces for
heads so that each holds the whole sequence, in rank order, for its H / S heads. After it,
``to_sequence`` trades back, from the kernel's ``[batch, S x L, H / S, head_dim]`` to the
rank's own tokens with every head, ``[batch, L, H x head_dim]``. Rank j's heads are heads
j H/S ... (j+1) H/S - 1. Both ride the differentiable all-to-all, so backward makes the reverse
trade of the gradients.

Outside the model: ``gather_rows`` and ``gather_objects`` bring every rank of the group its
peers' batch entries (``data``), and the position ids (``gather_rows`` along the sequence).
"""

from __future__ import annotations

from typing import Any

import torch

import zerolap.comm as dist
from zerolap.comm.differentiable import all_to_all

__all__ = ["gather_objects", "gather_rows", "to_heads", "to_sequence"]


def to_heads(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """``[b, H, L, d]`` (this rank's tokens, every head) -> ``[b, H/S, S L, d]``."""
    b, h, length, d = x.shape
    blocks = x.reshape(b, size, h // size, length, d).transpose(0, 1)  # by destination
    came = all_to_all(blocks, group)  # [S (whose tokens), b, H/S, L, d]
    return came.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * length, d)


def to_sequence(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """``[b, S L, H/S, d]`` (every token, this rank's heads) -> ``[b, L, H d]``."""
    b, whole, h, d = x.shape
    length = whole // size
    blocks = x.reshape(b, size, length, h, d).transpose(0, 1)  # by destination
    came = all_to_all(blocks, group)  # [S (whose heads), b, L, H/S, d]
    return came.permute(1, 2, 0, 3, 4).reshape(b, length, size * h * d)


def gather_rows(x: torch.Tensor, group, size: int, lengths: list[int] | None = None) -> list:
    """Every group rank's ``x`` (no gradient), in rank order. ``lengths``: their sizes along
    dim 1 when they may differ (each is sent padded to the longest, then cut)."""
    padded = x.contiguous()
    if lengths is not None and max(lengths) != x.shape[1]:
        padded = x.new_zeros((x.shape[0], max(lengths), *x.shape[2:]))
        padded[:, : x.shape[1]] = x
    pieces = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(pieces, padded, group=group)
    if lengths is None:
        return pieces
    return [piece[:, :n] for piece, n in zip(pieces, lengths, strict=True)]


def gather_objects(value: Any, group, size: int) -> list:
    """Every group rank's ``value`` (any picklable object), in rank order."""
    out: list = [None] * size
    dist.all_gather_object(out, value, group=group)
    return out
