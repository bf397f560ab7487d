"""ZB-H1's split backward: the input gradients now, the linear layers' weight gradients later.

A linear layer's backward is two products: ``g W`` for its input (what the previous stage waits
for) and ``g^T x`` for its weight (what nobody waits for until the step). ``DeferredWeights``
takes the second out of the backward, for every ``nn.Linear`` of a stage (exactly that class,
whose backward is known; other layers and every other parameter keep theirs):

* in a training forward, each call of such a layer keeps its input ``x`` and hooks its output,
  so that the input-gradient pass leaves the output's gradient ``g`` there;
* the input-gradient pass is autograd's backward asked for the stage's inputs and the other
  parameters only (``inputs=``): autograd then skips the weight products;
* the weight step computes ``g^T x`` (and ``sum g`` for the bias) per call and hands the sums
  to autograd's accumulation, so the reducer's hooks see them as any backward's gradients.

A layer whose input needs no gradient (it reads the data) would be skipped by the input-gradient
pass altogether, leaving no ``g``: its input is given to it as a leaf that needs one, which the
pass is asked for too (one product spent). A deferred weight used anywhere but in its own layer
would lose that use's gradient, so every training forward counts the graph's edges into each
deferred parameter: more than its layer's calls is a use elsewhere, named by the error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["DeferredWeights"]


@dataclass
class _Call:
    """One call of a deferred layer in one micro-batch's forward."""

    layer: nn.Linear
    x: torch.Tensor
    grad: torch.Tensor | None = None  # of the output, left by the input-gradient pass


class _Computed(torch.autograd.Function):
    """A node whose backward gives ``param`` the gradient of its layer's calls."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, uses: list) -> torch.Tensor:
        ctx.uses = uses
        return param.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        total = None
        for call, is_weight in ctx.uses:
            g = call.grad.reshape(-1, call.grad.shape[-1])
            grad = g.t() @ call.x.reshape(-1, call.x.shape[-1]) if is_weight else g.sum(0)
            total = grad if total is None else total.add_(grad)
        ctx.uses = None
        return total, None


def _input(args: tuple, kwargs: dict) -> torch.Tensor:
    """A linear layer's input, passed by position or as ``input=``."""
    return args[0] if args else kwargs["input"]


class DeferredWeights:
    def __init__(self, layers: list[nn.Linear], name_of: dict[int, str]) -> None:
        """``layers``: the stage's trainable ``nn.Linear`` modules whose parameters are
        deferred; ``name_of``: parameter id -> its name (for errors)."""
        found = {id(p): p for layer in layers for p in layer.parameters() if p.requires_grad}
        self.params = list(found.values())  # once each: layers may share a weight
        self._name_of = name_of
        self._calls: dict[object, list[_Call]] = {}  # per micro-batch key
        self._leaves: dict[object, list[torch.Tensor]] = {}  # inputs made leaves, per key
        self._key = None  # the micro-batch whose training forward is running
        # Told of each tensor kept for a weight step (True) and let go (False): what a
        # profiler counts as memory held (``benchmarks/pipe_bench.py``).
        self.observer: Callable[[torch.Tensor, bool], None] | None = None
        self._hooks = []
        for layer in layers:
            self._hooks.append(layer.register_forward_pre_hook(self._before, with_kwargs=True))
            self._hooks.append(layer.register_forward_hook(self._after, with_kwargs=True))

    # -- forward ------------------------------------------------------------------------------

    def record(self, key) -> None:
        """The training forward of micro-batch ``key`` starts: its layer calls are kept."""
        self._key = key
        self._calls[key], self._leaves[key] = [], []

    def stop(self, outputs) -> None:
        """That forward ended (``outputs``: what its backward starts from). Each one checks
        that deferred parameters are used by their own layers only (a model may branch
        differently per micro-batch; the walk visits each autograd node of the stage once,
        little next to the forward that built them)."""
        key, self._key = self._key, None
        if key is not None:
            self._check(outputs, self._calls[key])

    def _before(self, layer, args, kwargs):
        if self._key is None or not torch.is_grad_enabled():
            return None
        x = _input(args, kwargs)
        if x.requires_grad:
            return None
        leaf = x.detach().requires_grad_()  # so the input-gradient pass reaches the layer
        self._leaves[self._key].append(leaf)
        if args:
            return (leaf, *args[1:]), kwargs
        return args, {**kwargs, "input": leaf}

    def _after(self, layer, args, kwargs, output) -> None:
        if self._key is None or not torch.is_grad_enabled():
            return
        # Detached: the input tensor itself (a received activation) keeps the gradient the
        # input-gradient pass gives it, which must not live on until the weight step.
        call = _Call(layer, _input(args, kwargs).detach())
        self._calls[self._key].append(call)
        self._notify(call.x, True)

        def keep(grad: torch.Tensor) -> None:
            if call.grad is None:
                self._notify(grad, True)
                call.grad = grad
            else:
                call.grad = call.grad + grad

        output.register_hook(keep)

    def _notify(self, tensor: torch.Tensor, kept: bool) -> None:
        if self.observer is not None:
            self.observer(tensor, kept)

    def _let_go(self, calls: list[_Call]) -> None:
        for call in calls:
            self._notify(call.x, False)
            if call.grad is not None:
                self._notify(call.grad, False)

    # -- backward -----------------------------------------------------------------------------

    def extra_inputs(self, key) -> list[torch.Tensor]:
        """The leaves made for micro-batch ``key``'s layers, which the input-gradient pass must
        be asked for too."""
        return self._leaves.pop(key, [])

    def accumulate(self, key) -> None:
        """Micro-batch ``key``'s weight step: each deferred parameter's gradient, summed over
        its layer's calls, handed to autograd's accumulation one parameter at a time (so that
        one is alive at once, and the reducer's hooks take it as they take any backward's);
        a parameter whose calls got no gradient (outputs nothing used) gets none."""
        calls = self._calls.pop(key)
        roots = []
        # Autograd runs the newest node first: built in forward order, the last layers' come
        # first, the order of the gradient buckets.
        for param in self.params:
            uses = [
                (call, param is call.layer.weight)
                for call in calls
                if call.grad is not None
                and (param is call.layer.weight or param is call.layer.bias)
            ]
            if uses:
                roots.append(_Computed.apply(param, uses))
        if roots:
            # Computed inside autograd's backward, so that the accumulation owns each gradient
            # and takes it as it is (a gradient held from Python would be copied).
            torch.autograd.backward(roots, [torch.ones(())] * len(roots))
        self._let_go(calls)

    def drop(self) -> None:
        """Forget every micro-batch (a train_batch that raised)."""
        for calls in self._calls.values():
            self._let_go(calls)
        self._calls.clear()
        self._leaves.clear()
        self._key = None

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # -- the check ----------------------------------------------------------------------------

    def _check(self, outputs, calls: list[_Call]) -> None:
        """Count the graph's edges into each deferred parameter: one per call of its layer
        (through that call's own nodes); any more is a use elsewhere, whose gradient the
        split would lose."""
        deferred = {id(p): p for p in self.params}
        expected: dict[int, int] = {}
        for call in calls:
            for param in (call.layer.weight, call.layer.bias):
                if param is not None and id(param) in deferred:
                    expected[id(param)] = expected.get(id(param), 0) + 1
        roots = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn]
        seen, stack, found = set(), list(roots), {}
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            for child, _ in node.next_functions:
                variable = getattr(child, "variable", None)
                if variable is not None and id(variable) in deferred:
                    found[id(variable)] = found.get(id(variable), 0) + 1
                stack.append(child)
        for key, count in found.items():
            if count > expected.get(key, 0):
                raise ValueError(
                    f"pipeline.schedule=zb-h1: parameter {self._name_of.get(key, '?')} is used "
                    "outside its own nn.Linear layer, whose weight gradient ZB-H1 computes "
                    "apart (that use's gradient would be lost); use schedule 1f1b"
                )
