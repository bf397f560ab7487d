"""What the tensor-parallel overlap does: which all-reduces run while something else computes.

``Overlap.OFF``: every all-reduce is waited for where it is launched.

``Overlap.BACKWARD`` (DeepSpeed's ``tp_overlap_comm``, Megatron's): a column-parallel layer's
backward starts the all-reduce of its input gradient, computes its weight gradient meanwhile,
then waits. The forward all-reduces of row-parallel layers stay exposed, since what follows them
(the residual add, the next LayerNorm) needs their result.

``Overlap.FULL``: each Transformer block (a module of a ``ModuleList`` holding a row-parallel
layer) splits its micro-batch in two along the batch dimension and runs the halves as two
``lanes`` that take turns: while one half's row-parallel all-reduce is on the wire, the other
half computes its attention or MLP, including the residual and dropout work seed 002 §4 moves
under the all-reduce. The block's backward runs the same way, so a column-parallel layer's
input-gradient all-reduce of one half hides under the other half's backward, and under its own
weight gradient, before anyone waits for it. The halves' parameter gradients are summed and
reach the optimizer once, as if the block had run whole.

Splitting the batch changes nothing but the order of floating-point sums: results equal the
unsplit run's to rounding (1e-6 relative in fp32). It changes the layer's input for the rest
of the block only if samples interact, which in a decoder block they do not. A block's other
arguments are split when they are per-sample (a tensor of 2 or more dimensions whose first is
the batch) and passed whole otherwise (rotary tables, ``cache_position``). What cannot be split
is an error naming the argument: a KV cache (``use_cache=False`` turns it off for training) or
another argument that needs a gradient. Without gradients (evaluation, generation) blocks run
whole.
"""

from __future__ import annotations

import enum
import functools
import types
import warnings

import torch
from torch import nn

from zerolap.tensor_parallel import lanes
from zerolap.tensor_parallel.layers import RowParallelLinear

__all__ = ["Overlap", "blocks_of", "split_blocks"]


class Overlap(enum.Enum):
    OFF = "off"
    BACKWARD = "backward"
    FULL = "full"


def blocks_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The Transformer blocks of a tensor-parallel ``model``: the members of its
    ``ModuleList``s that hold a ``RowParallelLinear``, outermost lists only."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList):
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        for index, member in enumerate(module):
            if any(isinstance(m, RowParallelLinear) for m in member.modules()):
                found.append((f"{name}.{index}", member))
    return found


def split_blocks(model: nn.Module) -> list[str]:
    """Make every block of ``model`` run its micro-batch as two lanes (``Overlap.FULL``);
    returns the blocks' names. An error when the model has no such block."""
    blocks = blocks_of(model)
    if not blocks:
        raise ValueError(
            "tensor_parallel.overlap=full: no block to split in "
            f"{type(model).__name__} (a member of an nn.ModuleList holding a row-parallel layer)"
        )
    for name, block in blocks:
        block.forward = types.MethodType(functools.partial(_forward_in_lanes, name), block)
    return [name for name, _ in blocks]


def _forward_in_lanes(name: str, block: nn.Module, *args, **kwargs):
    whole = functools.partial(type(block).forward, block)
    if not torch.is_grad_enabled() or lanes.in_lanes():
        return whole(*args, **kwargs)
    if args and torch.is_tensor(args[0]):
        x, rest, key = args[0], args[1:], None
    elif torch.is_tensor(kwargs.get("hidden_states")):
        x, rest, key = kwargs["hidden_states"], args, "hidden_states"
    else:
        raise ValueError(
            f"tensor_parallel.overlap=full: block {name} was called without a tensor first "
            "argument or hidden_states= to split"
        )
    batch = x.shape[0]
    if batch < 2:
        _warn_unsplit(name, batch)
        return whole(*args, **kwargs)
    others = {k: v for k, v in kwargs.items() if k != key}
    halves = [_half(rest, batch, i, name, "args") for i in (0, 1)]
    kw_halves = [_half(others, batch, i, name, "kwargs") for i in (0, 1)]

    def run(index: int, x_half: torch.Tensor) -> list[torch.Tensor | None]:
        args_i, kwargs_i = halves[index], dict(kw_halves[index])
        if key is None:
            return whole(x_half, *args_i, **kwargs_i)
        return whole(*args_i, **kwargs_i, **{key: x_half})

    shape = _Shape(name)  # how the block's output looks, learnt in _TwoLanes.forward
    params = [p for p in block.parameters() if p.requires_grad]
    return shape.rebuild(_TwoLanes.apply(run, shape, x, *params))


_warned: set[str] = set()


def _warn_unsplit(name: str, batch: int) -> None:
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"tensor_parallel.overlap=full: block {name} got a micro-batch of {batch}, which "
            "cannot be split in two; it runs whole (only the backward overlap applies)",
            stacklevel=4,
        )


def _half(value, batch: int, index: int, block: str, where: str):
    """``value``'s per-sample tensors cut to half ``index``; everything else as it is."""
    if torch.is_tensor(value):
        if value.requires_grad:
            raise ValueError(
                f"tensor_parallel.overlap=full: block {block} got a tensor in its {where} that "
                "needs a gradient besides the hidden states; the split only carries that one"
            )
        if value.dim() >= 2 and value.shape[0] == batch:
            return value.tensor_split(2)[index]
        return value
    if isinstance(value, tuple | list):
        return type(value)(_half(v, batch, index, block, where) for v in value)
    if isinstance(value, dict):
        return {k: _half(v, batch, index, block, f"{where} {k!r}") for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str | torch.dtype):
        return value
    raise ValueError(
        f"tensor_parallel.overlap=full: block {block} got a {type(value).__name__} in its "
        f"{where}, which cannot be split in two along the batch (a KV cache: pass "
        "use_cache=False for training)"
    )


class _Shape:
    """A block's output (a tensor, or a tuple of tensors and Nones) taken apart into the tensors
    an autograd Function can return, and put back together after."""

    def __init__(self, block: str) -> None:
        self.block = block
        self.single = True
        self.none_at: set[int] = set()
        self.length = 1

    def flatten(self, out) -> list[torch.Tensor]:
        if torch.is_tensor(out):
            self.single = True
            return [out]
        if isinstance(out, tuple | list) and all(o is None or torch.is_tensor(o) for o in out):
            self.single, self.length = False, len(out)
            self.none_at = {i for i, o in enumerate(out) if o is None}
            return [o for o in out if o is not None]
        raise ValueError(
            f"tensor_parallel.overlap=full: block {self.block} returned a "
            f"{type(out).__name__}; a split block must return a tensor or a tuple of tensors "
            "(and Nones)"
        )

    def rebuild(self, flat: tuple[torch.Tensor, ...] | torch.Tensor):
        if not isinstance(flat, tuple):
            flat = (flat,)
        if self.single:
            return flat[0]
        values = iter(flat)
        return tuple(None if i in self.none_at else next(values) for i in range(self.length))


class _TwoLanes(torch.autograd.Function):
    """A block run as two lanes, forward and backward. Its inputs are the hidden states and the
    block's parameters, so that the halves' parameter gradients leave it summed, once."""

    @staticmethod
    def forward(ctx, run, shape: _Shape, x, *params):
        halves = [h.detach().requires_grad_(x.requires_grad) for h in x.tensor_split(2)]

        def lane(index: int) -> list[torch.Tensor]:
            with torch.enable_grad():
                return shape.flatten(run(index, halves[index]))

        outs = lanes.run_two(lane)
        if len(outs[0]) != len(outs[1]):
            raise RuntimeError(
                f"tensor_parallel.overlap=full: the halves of block {shape.block} returned "
                "different outputs"
            )
        ctx.halves, ctx.params, ctx.outs = halves, params, outs
        joined = tuple(torch.cat([a.detach(), b.detach()]) for a, b in zip(*outs, strict=True))
        return joined if len(joined) > 1 else joined[0]

    @staticmethod
    def backward(ctx, *grads):
        with_x = ctx.halves[0].requires_grad

        def lane(index: int):
            pairs = [
                (out, grad.tensor_split(2)[index])
                for out, grad in zip(ctx.outs[index], grads, strict=True)
                if out.requires_grad
            ]
            inputs = ([ctx.halves[index]] if with_x else []) + list(ctx.params)
            got = torch.autograd.grad(
                [o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True
            )
            # A half that left an input unused gives it a zero gradient.
            return [
                torch.zeros_like(i) if g is None else g for i, g in zip(inputs, got, strict=True)
            ]

        first, second = lanes.run_two(lane)
        del ctx.outs, ctx.halves, ctx.params
        grad_x = torch.cat([first.pop(0), second.pop(0)]) if with_x else None
        return (None, None, grad_x, *(a + b for a, b in zip(first, second, strict=True)))
