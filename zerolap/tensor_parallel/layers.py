"""What tensor parallelism computes: layers whose weights are split over the tensor group.

* ``ColumnParallelLinear``: the output features are split. Input replicated, output split
  (or gathered whole with ``gather_output``). Its backward sums the input gradient over the
  group (Megatron's *f*), fused into the layer so that the all-reduce can be *started before*
  the weight gradient is computed and waited for after it (``overlap_backward``); layers that
  read the same tensor reduce their summed gradients once (``shared_input``).
* ``RowParallelLinear``: the input features are split. Input split, output partial sums,
  all-reduced (Megatron's *g*), then the bias, which every rank holds whole, is added once.
* ``VocabParallelEmbedding``: the vocabulary rows are split; each rank looks up the tokens it
  holds, zeros the rest, and the ranks' outputs are summed.

Every split weight is *cut from a whole one*: ``from_dense`` slices an existing layer, and the
constructors build the dense layer first (torch's default initialisation, from the current RNG)
and slice it, so a tensor-parallel model built from the same seed starts exactly equal to the
dense model. Each split parameter carries a ``Split`` (``param.tp_split``) saying which piece
of the whole it is, plus Megatron's ``tensor_model_parallel`` / ``partition_dim`` attributes
that other tools read. Fused projections (a GPT's QKV) are split per block with ``parts``: the
output rows are ``parts`` equal blocks (or blocks of the sizes given, for fewer key/value heads
than query heads) and each block is cut in T, so every rank keeps whole heads of Q, K and V.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import zerolap.comm as dist
from zerolap.tensor_parallel import lanes
from zerolap.tensor_parallel.mappings import (
    BACKWARD,
    all_reduce_,
    gather_from_region,
    reduce_from_region,
    scatter_to_region,
    wait,
)
from zerolap.tensor_parallel.shared_input import SharedInput

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "Split",
    "VocabParallelEmbedding",
    "is_tensor_parallel",
    "join_pieces",
]


Parts = int | tuple[int, ...]
"""A fused projection's blocks along its split dimension: that many equal blocks, or the
blocks' sizes (a QKV with fewer key/value heads than query heads: ``(q, kv, kv)``)."""


@dataclass(frozen=True)
class Split:
    """Where a split parameter's piece sits in the whole parameter: along ``dim`` the whole is
    blocks of sizes ``blocks``, and this piece is slice ``index`` of ``count`` of every block."""

    full_shape: tuple[int, ...]
    dim: int
    blocks: tuple[int, ...]
    index: int
    count: int

    @property
    def parts(self) -> int:
        return len(self.blocks)

    def _blocks(self) -> list[tuple[int, int, int]]:
        """Per block: its start in the whole, its slice's length, its slice's start in the
        piece."""
        out, start, local = [], 0, 0
        for size in self.blocks:
            step = size // self.count
            out.append((start, step, local))
            start, local = start + size, local + step
        return out

    def block_ranges(self) -> list[tuple[int, int]]:
        """The ``(start, end)`` index ranges along ``dim`` of the whole that this piece holds,
        one per block, in order."""
        return [
            (start + self.index * step, start + (self.index + 1) * step)
            for start, step, _ in self._blocks()
        ]

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This piece cut from the whole tensor ``full``."""
        return torch.cat(
            [full.narrow(self.dim, a, b - a) for a, b in self.block_ranges()], self.dim
        )

    def put(self, piece: torch.Tensor, full: torch.Tensor) -> None:
        """Write this piece into its place in the whole tensor ``full``."""
        for (a, b), (_, step, local) in zip(self.block_ranges(), self._blocks(), strict=True):
            full.narrow(self.dim, a, b - a).copy_(piece.narrow(self.dim, local, step))

    def full_ranges(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """The piece's flat elements ``[lo, hi)`` as ranges of the whole tensor's flat elements:
        ``(full_start, full_end, offset of full_start from lo)``, in the piece's order. A
        split along dimension 0 gives one range per block; along a later dimension, one per
        block of every index of the dimensions before it."""
        shape = self.full_shape
        inner = math.prod(shape[self.dim + 1 :])
        full_dim = shape[self.dim]
        blocks = self._blocks()
        span = sum(step for _, step, _ in blocks) * inner  # per index of the dims before
        out = []
        for outer in range(lo // span, -(-hi // span)):
            for block_start, step, local in blocks:
                start = outer * span + local * inner
                a, b = max(lo, start), min(hi, start + step * inner)
                if a < b:
                    full = (outer * full_dim + block_start + self.index * step) * inner
                    out.append((full + a - start, full + b - start, a - lo))
        return out


def block_sizes(size: int, parts: Parts, count: int, what: str) -> tuple[int, ...]:
    """The blocks ``parts`` describes for a dimension of ``size``, each of which must split
    evenly over ``count`` ranks."""
    if isinstance(parts, int):
        sizes = (size // parts,) * parts if size % parts == 0 else None
        detail = f" in {parts} blocks" if parts > 1 else ""
    else:
        sizes = tuple(parts)
        detail = f" in blocks of {list(sizes)}"
        if sum(sizes) != size:
            raise ValueError(
                f"tensor parallelism: {what} has {size} along its split dimension, but its "
                f"fused blocks {list(sizes)} add up to {sum(sizes)}"
            )
    if sizes is None or any(block % count for block in sizes):
        raise ValueError(
            f"tensor parallelism: {what} has {size} along its split dimension, not divisible by "
            f"the tensor-parallel size {count}{detail}"
        )
    return sizes


def _split_parameter(full: torch.Tensor, dim: int, parts: Parts, group, what: str) -> nn.Parameter:
    count, index = dist.get_world_size(group), dist.get_rank(group)
    blocks = block_sizes(full.shape[dim], parts, count, what)
    split = Split(tuple(full.shape), dim, blocks, index, count)
    param = nn.Parameter(split.take(full.detach()).clone(), requires_grad=full.requires_grad)
    mark_split(param, split, group)
    return param


def mark_split(param: nn.Parameter, split: Split, group) -> None:
    """Tag ``param`` as a tensor-parallel piece of the ranks of ``group`` (ours and
    Megatron's attribute names)."""
    param.tp_split = split
    param.tp_group = group
    param.tensor_model_parallel = True
    param.partition_dim = split.dim
    # Megatron's stride: that many equal blocks, each cut over the ranks. Blocks of unequal
    # sizes have no stride in its terms; ``tp_split`` describes them.
    param.partition_stride = split.parts if len(set(split.blocks)) == 1 else 1


def join_pieces(piece: torch.Tensor, split: Split, group) -> torch.Tensor:
    """The whole tensor, on every rank of ``group``, from each rank's ``piece`` of it."""
    pieces = dist.all_gather(piece.detach().contiguous(), group=group)
    full = torch.empty(split.full_shape, dtype=piece.dtype, device=piece.device)
    for index, each in enumerate(pieces):
        Split(split.full_shape, split.dim, split.blocks, index, split.count).put(each, full)
    return full


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` is a piece of a split parameter (its other pieces on the other ranks
    of the tensor group), as opposed to replicated on all of them."""
    return bool(
        getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False)
    )


def _linear(x, weight, bias, transposed: bool) -> torch.Tensor:
    """``nn.Linear`` (weight ``(out, in)``) or, ``transposed``, Hugging Face's ``Conv1D``
    (weight ``(in, out)``)."""
    if not transposed:
        return F.linear(x, weight, bias)
    y = x.matmul(weight)
    return y if bias is None else y + bias


def _blank(cls):
    """A layer of class ``cls`` with nothing in it yet, for ``from_dense`` to fill from an
    existing dense layer (the constructors would build and initialise a dense one first)."""
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    return layer


def _bias_split(bias: torch.Tensor | None, parts: Parts, group, what: str) -> nn.Parameter | None:
    return None if bias is None else _split_parameter(bias, 0, parts, group, what)


class _ColumnParallelMatmul(torch.autograd.Function):
    """``x @ weight.T + bias`` with ``x`` replicated and ``weight`` this rank's output rows.
    Backward sums the input gradient over the group, once for every column-parallel layer that
    read ``x`` (``shared``: the last of them to arrive reduces the sum); with ``overlap`` that
    all-reduce runs while the weight and bias gradients are computed (they do not depend on
    it)."""

    @staticmethod
    def forward(ctx, x, weight, bias, shared, group, overlap, transposed):
        ctx.save_for_backward(x, weight)
        ctx.shared, ctx.group, ctx.overlap, ctx.transposed = shared, group, overlap, transposed
        ctx.has_bias = bias is not None
        return _linear(x, weight, bias, transposed)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = handle = None
        if need_x:
            grad_x = ctx.shared.arrive(grad.matmul(weight.t() if ctx.transposed else weight))
            if grad_x is None:  # another reader of x reduces the sum
                grad_x = grad.new_zeros(()).expand(x.shape)
            else:
                handle = all_reduce_(grad_x, ctx.group, name=BACKWARD)
                if ctx.overlap:
                    lanes.switch()  # the other half's backward computes meanwhile
                else:
                    wait(handle)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        flat_x = x.reshape(-1, x.shape[-1])
        grad_w = None
        if need_w:
            grad_w = (
                flat_x.t().matmul(flat_grad) if ctx.transposed else flat_grad.t().matmul(flat_x)
            )
        grad_b = flat_grad.sum(0) if need_b and ctx.has_bias else None
        wait(handle)
        return grad_x, grad_w, grad_b, None, None, None, None


class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` with its output features split over ``group`` (see the module doc).
    ``transposed``: the weight is stored ``(in, out)``, as in Hugging Face's ``Conv1D``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group,
        parts: Parts = 1,
        gather_output: bool = False,
        overlap_backward: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        dense = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._take(dense, group, parts, gather_output, overlap_backward, transposed=False)

    def _take(self, dense, group, parts, gather_output, overlap_backward, transposed) -> None:
        self.group = group
        self.parts = parts
        self.gather_output = gather_output
        self.overlap_backward = overlap_backward
        self.transposed = transposed
        out_dim = 1 if transposed else 0
        self.in_features = dense.weight.shape[1 - out_dim]
        self.out_features = dense.weight.shape[out_dim] // dist.get_world_size(group)
        self.weight = _split_parameter(
            dense.weight, out_dim, parts, group, "ColumnParallelLinear weight"
        )
        self.bias = _bias_split(dense.bias, parts, group, "ColumnParallelLinear bias")

    @classmethod
    def from_dense(
        cls,
        dense: nn.Module,
        *,
        group,
        parts: Parts = 1,
        gather_output: bool = False,
        overlap_backward: bool = True,
        transposed: bool = False,
        weight: nn.Parameter | None = None,
    ) -> ColumnParallelLinear:
        """``dense``'s (an ``nn.Linear``, or with ``transposed`` a ``Conv1D``) output features
        split over ``group``; ``weight``, when given, is an already split parameter to use
        instead (a head tied to a vocab-parallel embedding)."""
        layer = _blank(cls)
        layer._take(dense, group, parts, gather_output, overlap_backward, transposed)
        if weight is not None:
            if weight.shape != layer.weight.shape:
                raise ValueError(
                    f"tensor parallelism: tied weight of shape {tuple(weight.shape)} does not "
                    f"match the split {tuple(layer.weight.shape)}"
                )
            layer.weight = weight
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ColumnParallelMatmul.apply(
            x,
            self.weight,
            self.bias,
            SharedInput.of(x, self.group),
            self.group,
            self.overlap_backward,
            self.transposed,
        )
        if not self.gather_output:
            return y
        return _in_block_order(gather_from_region(y, self.group), self.weight.tp_split)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (per rank), "
            f"bias={self.bias is not None}, parts={self.parts}, transposed={self.transposed}"
        )


def _in_block_order(gathered: torch.Tensor, split: Split) -> torch.Tensor:
    """The ranks' outputs, gathered rank after rank along the last dimension, in the whole
    layer's order: with fused blocks each rank holds a slice of every block, so block k's
    slices are collected from every rank before block k + 1's."""
    if split.parts == 1:
        return gathered
    steps = [size // split.count for size in split.blocks]
    ranks = [piece.split(steps, dim=-1) for piece in gathered.split(sum(steps), dim=-1)]
    return torch.cat([ranks[r][k] for k in range(split.parts) for r in range(split.count)], -1)


class RowParallelLinear(nn.Module):
    """``nn.Linear`` with its input features split over ``group`` (see the module doc).
    ``transposed``: the weight is stored ``(in, out)``, as in Hugging Face's ``Conv1D``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group,
        input_is_parallel: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        dense = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._take(dense, group, input_is_parallel, transposed=False)

    def _take(self, dense, group, input_is_parallel, transposed) -> None:
        self.group = group
        self.input_is_parallel = input_is_parallel
        self.transposed = transposed
        in_dim = 0 if transposed else 1
        self.in_features = dense.weight.shape[in_dim] // dist.get_world_size(group)
        self.out_features = dense.weight.shape[1 - in_dim]
        self.weight = _split_parameter(dense.weight, in_dim, 1, group, "RowParallelLinear weight")
        # The bias is added once, after the sum: every rank holds it whole (replicated).
        bias = dense.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())

    @classmethod
    def from_dense(
        cls, dense: nn.Module, *, group, input_is_parallel: bool = True, transposed: bool = False
    ) -> RowParallelLinear:
        """``dense``'s (an ``nn.Linear``, or with ``transposed`` a ``Conv1D``) input features
        split over ``group``."""
        layer = _blank(cls)
        layer._take(dense, group, input_is_parallel, transposed)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group)
        y = reduce_from_region(_linear(x, self.weight, None, self.transposed), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (per rank), out_features={self.out_features}, "
            f"bias={self.bias is not None}, transposed={self.transposed}"
        )


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with its rows (the vocabulary) split over ``group``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group,
        padding_idx: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        dense = nn.Embedding(
            num_embeddings, embedding_dim, padding_idx=padding_idx, device=device, dtype=dtype
        )
        self._take(dense, group)

    def _take(self, dense: nn.Embedding, group) -> None:
        if dense.max_norm is not None or dense.sparse:
            raise ValueError(
                "tensor parallelism: VocabParallelEmbedding does not take max_norm or sparse "
                "embeddings (their renormalisation and sparse gradients are per whole table)"
            )
        self.group = group
        self.num_embeddings = dense.num_embeddings
        self.embedding_dim = dense.embedding_dim
        self.weight = _split_parameter(dense.weight, 0, 1, group, "VocabParallelEmbedding")
        rows = self.weight.shape[0]
        self.vocab_start = dist.get_rank(group) * rows
        self.vocab_end = self.vocab_start + rows
        padding = dense.padding_idx
        self.padding_idx = (
            padding - self.vocab_start
            if padding is not None and self.vocab_start <= padding < self.vocab_end
            else None
        )

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, *, group) -> VocabParallelEmbedding:
        layer = _blank(cls)
        layer._take(embedding, group)
        return layer

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight, self.padding_idx)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_region(rows, self.group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows "
            f"{self.vocab_start}..{self.vocab_end - 1} on this rank"
        )
