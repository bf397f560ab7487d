"""Column-parallel layers fed the same tensor share one input-gradient all-reduce.

A column-parallel layer's input gradient is a partial sum on each rank of the tensor group and
must be summed over the group (Megatron's *f*). Where several column-parallel layers read one
tensor (a Llama block's separate ``q_proj`` / ``k_proj`` / ``v_proj``, its ``gate_proj`` and
``up_proj``), summing their partial gradients first and reducing once moves the bytes of one
all-reduce instead of one per layer: what a fused QKV gives, without fusing the weights.

``SharedInput.of(x, group)`` is what the readers of ``x`` share, made by the first of them. In
backward each reader ``arrive``s with its partial gradient; the last to arrive gets the sum,
reduces it (in its own backward, so that the all-reduce still runs under its weight gradient)
and returns it, the others return zeros (an expanded scalar: no memory). A reader whose backward
never runs (its output took no part in the loss) would leave the others' partial sum behind, so
a hook on ``x``, which runs once every reader of this backward has delivered, reduces whatever
is still pending and adds it. Every rank runs the same graph, so the reductions happen in the
same order on all of them.

Nothing here refers back to ``x``: the sharing hangs off ``x`` (an attribute, and the hook) and
dies with it, where a reference from the sharing to ``x`` would make a cycle through the
autograd graph that Python's collector cannot free.
"""

from __future__ import annotations

import torch

from zerolap.tensor_parallel.mappings import BACKWARD, all_reduce_now

__all__ = ["SharedInput"]

_ATTRIBUTE = "_zerolap_tp_shared_input"


class SharedInput:
    def __init__(self, group) -> None:
        self.group = group
        self.readers = 0  # column-parallel reads of the tensor, over every forward through it
        self.arrived = 0  # of those, the ones whose backward delivered in the current pass
        self.pending: torch.Tensor | None = None  # partial gradients not yet reduced
        self.task = None  # the autograd pass they arrived in

    @classmethod
    def of(cls, x: torch.Tensor, group) -> SharedInput | None:
        """Join the sharing of ``x``'s column-parallel readers in ``group``, made by the first of
        them; None when no gradient will flow back to ``x``."""
        if not (torch.is_grad_enabled() and x.requires_grad):
            return None
        shared = getattr(x, _ATTRIBUTE, None)
        if shared is None or shared.group is not group:
            shared = cls(group)
            setattr(x, _ATTRIBUTE, shared)
            x.register_hook(shared._flush)
        shared.readers += 1
        return shared

    def arrive(self, partial: torch.Tensor) -> torch.Tensor | None:
        """Add one reader's partial input gradient: the sum of every one not reduced yet when
        this is the last reader to arrive (its caller reduces it), None otherwise."""
        task = torch._C._current_graph_task_id()
        if task != self.task:
            # A new backward pass: what an earlier one left pending (it never needed x's
            # gradient, as ``autograd.grad`` of the weights alone) is not part of this one.
            self.task, self.arrived, self.pending = task, 0, None
        self.arrived += 1
        self.pending = partial if self.pending is None else self.pending.add_(partial)
        if self.arrived < self.readers:
            return None
        total, self.pending = self.pending, None
        return total

    def _flush(self, grad: torch.Tensor) -> torch.Tensor:
        """The hook on the shared tensor: add what readers whose backward did not run left
        (in this pass: an earlier one's leftovers are not part of this gradient)."""
        if self.pending is None or self.task != torch._C._current_graph_task_id():
            self.pending = None
            return grad
        left, self.pending = self.pending, None
        return grad + all_reduce_now(left, self.group, name=BACKWARD)
