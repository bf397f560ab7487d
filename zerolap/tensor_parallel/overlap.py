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

Splitting the batch changes nothing but the order of floating-point sums, since the samples of a
decoder block do not interact: results equal the unsplit run's to rounding (1e-6 relative in
fp32). The batch is dimension 0 of the block's hidden states, checked against the batch of the
model's own input (a sequence-first model is an error, not a split along the sequence). A
block's other arguments are split when they are per-sample (a tensor of 2 or more dimensions
whose first is the batch) and passed whole otherwise (rotary tables, ``cache_position``). An
empty KV cache (what Hugging Face models create in training unless ``use_cache=False``) is left
out, with a warning. Errors, naming the block, for what the split cannot carry: a cache holding
keys, another argument or an outside parameter that needs a gradient, active saved-tensor hooks
(activation checkpointing, ``save_on_cpu``), a second backward through the same graph, and
blocks on an accelerator (the lanes' backward needs a thread per lane, and autograd runs every
CUDA node on one thread). Without gradients (evaluation, generation) blocks run whole.
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
    seen = _ModelBatch()
    model.register_forward_pre_hook(seen, with_kwargs=True)
    for name, block in blocks:
        split = _SplitBlock(name, block, seen)
        block.forward = types.MethodType(functools.partial(_forward_in_lanes, split), block)
    return [name for name, _ in blocks]


class _ModelBatch:
    """The batch size of the model's own input (its first tensor argument, token ids or
    embeddings, batch first), seen by a forward pre-hook on the model."""

    def __init__(self) -> None:
        self.size: int | None = None

    def __call__(self, module, args, kwargs) -> None:
        first = next(
            (v for v in (*args, *kwargs.values()) if torch.is_tensor(v) and v.dim() >= 1), None
        )
        self.size = None if first is None else first.shape[0]


class _SplitBlock:
    """One block's split: its name, its trainable parameters (the lanes' backward returns
    their gradients), and whether its graph was checked for outside leaves yet."""

    def __init__(self, name: str, block: nn.Module, batch: _ModelBatch) -> None:
        self.name = name
        self.batch = batch
        self.params = [p for p in block.parameters() if p.requires_grad]
        self.checked = False

    def fail(self, message: str) -> ValueError:
        return ValueError(f"tensor_parallel.overlap=full: block {self.name} {message}")


def _forward_in_lanes(split: _SplitBlock, block: nn.Module, *args, **kwargs):
    whole = functools.partial(type(block).forward, block)
    if not torch.is_grad_enabled() or lanes.in_lanes():
        return whole(*args, **kwargs)
    if args and torch.is_tensor(args[0]):
        x, rest, key = args[0], args[1:], None
    elif torch.is_tensor(kwargs.get("hidden_states")):
        x, rest, key = kwargs["hidden_states"], args, "hidden_states"
    else:
        raise split.fail("was called without a tensor first argument or hidden_states= to split")
    _check_splittable(split, x)
    batch = x.shape[0]
    if batch < 2:
        message = f"tensor_parallel.overlap=full: block {split.name} got a micro-batch of "
        message += f"{batch}, which cannot be split in two; it runs whole (the backward overlap "
        message += "applies)"
        _warn_once(split.name, message)
        return whole(*args, **kwargs)
    others = {k: v for k, v in kwargs.items() if k != key}
    halves = [_half(rest, batch, i, split.name, "args") for i in (0, 1)]
    kw_halves = [_half(others, batch, i, split.name, "kwargs") for i in (0, 1)]

    def run(index: int, x_half: torch.Tensor):
        args_i, kwargs_i = halves[index], dict(kw_halves[index])
        if key is None:
            return whole(x_half, *args_i, **kwargs_i)
        return whole(*args_i, **kwargs_i, **{key: x_half})

    shape = _Shape(split)  # how the block's output looks, learnt in _TwoLanes.forward
    return shape.rebuild(_TwoLanes.apply(run, shape, x, *split.params))


def _check_splittable(split: _SplitBlock, x: torch.Tensor) -> None:
    if x.device.type != "cpu":
        raise split.fail(
            f"runs on {x.device.type}: the full overlap runs on CPU only for now (autograd runs "
            "every CUDA node of a backward on one thread, so the lanes' backward would wait on "
            "itself); use overlap: backward"
        )
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        raise split.fail(
            "runs under saved-tensor hooks (activation checkpointing, save_on_cpu), which do not "
            "follow the lanes onto their threads; use overlap: backward with them"
        )
    if split.batch.size is not None and x.dim() >= 1 and x.shape[0] != split.batch.size:
        raise split.fail(
            f"got hidden states of shape {tuple(x.shape)}, whose first dimension is not the "
            f"model's batch ({split.batch.size}): the split needs the batch first"
        )


_warned: set[str] = set()


def _warn_once(block: str, message: str) -> None:
    key = f"{block}: {message.split(';')[0]}"
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=4)


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
    seq_length = getattr(value, "get_seq_length", None)
    if callable(seq_length) and seq_length() == 0:
        # A fresh KV cache (Hugging Face models make one in training unless use_cache=False):
        # nothing to read from it, and training never reads what it would collect.
        _warn_once(
            block,
            f"tensor_parallel.overlap=full: block {block} runs its halves without the empty "
            f"{type(value).__name__} it was given (pass use_cache=False to say so); the model "
            "returns no cached keys and values",
        )
        return None
    raise ValueError(
        f"tensor_parallel.overlap=full: block {block} got a {type(value).__name__} in its "
        f"{where}, which cannot be split in two along the batch (a KV cache holding keys: "
        "run such calls without gradients, or with overlap off)"
    )


class _Shape:
    """A block's output (a tensor, or a tuple of tensors and Nones) taken apart into the tensors
    an autograd Function can return, and put back together after."""

    def __init__(self, split: _SplitBlock) -> None:
        self.split = split
        self.single = True
        self.none_at: set[int] = set()
        self.length = 1

    def flatten(self, out) -> list[torch.Tensor]:
        if torch.is_tensor(out):
            self.single, tensors = True, [out]
        elif isinstance(out, tuple | list) and all(o is None or torch.is_tensor(o) for o in out):
            self.single, self.length = False, len(out)
            self.none_at = {i for i, o in enumerate(out) if o is None}
            tensors = [o for o in out if o is not None]
        else:
            raise self.split.fail(
                f"returned a {type(out).__name__}; a split block must return a tensor or a tuple "
                "of tensors (and Nones)"
            )
        if any(t.dim() == 0 for t in tensors):
            raise self.split.fail("returned a scalar; a split block's outputs are per sample")
        return tensors

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
                # Not the leaf itself, which a block writing into its input could not touch.
                return shape.flatten(run(index, halves[index].clone()))

        outs = lanes.run_two(lane)
        split = shape.split
        if len(outs[0]) != len(outs[1]):
            raise split.fail("returned different outputs for its two halves")
        if not split.checked:
            _check_leaves(split, outs, halves)
            split.checked = True
        ctx.halves, ctx.params, ctx.outs = halves, params, outs
        joined = tuple(torch.cat([a.detach(), b.detach()]) for a, b in zip(*outs, strict=True))
        return joined if len(joined) > 1 else joined[0]

    @staticmethod
    def backward(ctx, *grads):
        if not hasattr(ctx, "outs"):
            raise RuntimeError(
                "tensor_parallel.overlap=full: a split block's graph takes one backward "
                "(retain_graph is not supported); use overlap: backward"
            )
        with_x = ctx.halves[0].requires_grad

        def lane(index: int):
            pairs = [
                (out, grad.split([o.shape[0] for o in pair])[index])
                for out, grad, pair in zip(
                    ctx.outs[index], grads, zip(*ctx.outs, strict=True), strict=True
                )
                if out.requires_grad
            ]
            inputs = ([ctx.halves[index]] if with_x else []) + list(ctx.params)
            return torch.autograd.grad(
                [o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True
            )

        first, second = lanes.run_two(lane)
        halves = ctx.halves
        del ctx.outs, ctx.halves, ctx.params
        grad_x = None
        if with_x:
            pair = zip((first[0], second[0]), halves, strict=True)
            grad_x = torch.cat([torch.zeros_like(h) if g is None else g for g, h in pair])
            first, second = first[1:], second[1:]
        return (None, None, grad_x, *(_sum(a, b) for a, b in zip(first, second, strict=True)))


def _sum(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """The halves' gradients of one parameter; None when neither half used it."""
    return a if b is None else b if a is None else a + b


def _check_leaves(split: _SplitBlock, outs, halves) -> None:
    """The lanes' backward returns gradients for the hidden states and the block's own
    parameters only: any other leaf that needs one (a parameter owned outside the block) would
    silently get none. Checked once per block, on its first split forward."""
    known = {id(p) for p in split.params} | {id(h) for h in halves}
    stack = [o.grad_fn for lane in outs for o in lane if o.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad: a leaf
        if variable is not None and id(variable) not in known:
            raise split.fail(
                f"uses a tensor of shape {tuple(variable.shape)} that needs a gradient and is "
                "neither its hidden states nor one of its own parameters; the split would drop "
                "its gradient"
            )
        stack.extend(next_node for next_node, _ in node.next_functions)
