"""Gradient hooks -> buckets -> collectives -> gradient storage.

Phases of one backward:

1. ``begin_backward(reduce, scope)``: buckets return to EMPTY. ``reduce`` is false for a
   micro-batch whose gradients only accumulate locally (stages 0-1 before the accumulation
   boundary); ``scope`` limits a reducing backward to some buckets (an interleaved pipeline's
   chunk: its backward reaches only that chunk's parameters, and the others' buckets are not
   reduced as zeros).
2. Hook, once per parameter gradient: the gradient is written into the storage (and the
   autograd tensor dropped), the parameter's bucket is marked; a completed bucket becomes READY
   and, with ``overlap_comm``, READY buckets are launched at once in index order, so their
   collectives run on the backend's threads while autograd computes earlier layers.
   ``batched`` (stage 3, whose buckets are modules' units, or runs of units coalesced up to
   ``reduce_bucket_size``) holds a unit's gradients until its last one comes and writes them
   together, one multi-tensor copy where a copy each would cost an accelerator's host a
   kernel launch each.
3. ``finish_backward()``: the one place that waits. Buckets still filling (parameters that got
   no gradient this step) are launched with zeros in their place, every handle is waited in
   order, results are scaled and delivered; buckets refilled by late gradients get a second
   round.

Without ``overlap_comm`` phase 2 only records readiness and launches happen in phase 3, except
when a bucket needs a buffer and the storage's pool is used up (stage 2's few bucket buffers):
then the ready buckets are reduced there, in order, and waited for, so that no reduction runs
while autograd computes.

``in_place`` (stages 0-2 without ``overlap_comm``, on an accelerator; the engine chooses it):
there is no phase 2. Each parameter's ``.grad`` is its place in a buffer of the storage's,
zeroed where a round starts (``start_in_place``: stages 0-1 before a cycle's first backward,
stage 2 before every backward, whose reduction lands in the shard), so autograd's own
accumulation adds every gradient there, and nothing of this module runs per parameter while
autograd computes (on a GPU the host's per-parameter hooks are what backward waits on). The
buffer is stages 0-1's flat gradient, or at stage 2 one buffer for every bucket, where the
hooks would have filled as many from their pool (from the first backward on: its peak can be
higher by the buckets the hooks had not filled yet). The cost is a zeroing and an add where
the hooks copied: a pass over the gradients that a GPU does in a fraction of what the hooks
cost the host, and a CPU does not, so it is not chosen there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zerolap.utils.logging import logger
from zerolap.zero.bucket import Bucket, BucketState
from zerolap.zero.layout import FlatLayout

__all__ = ["BackwardTiming", "GradReducer"]


@dataclass(frozen=True)
class BackwardTiming:
    """When autograd finished (``time.perf_counter``) and how long ``finish_backward`` then
    blocked on collectives: the communication that backward's compute did not hide."""

    compute_end: float
    exposed_wait_s: float


class GradReducer:
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        layout: FlatLayout,
        storage,
        reduction,
        *,
        overlap: bool,
        in_place: bool = False,
        batched: bool = False,
        names: list[str] | None = None,
    ) -> None:
        self.params = params  # in layout slot order
        self.names = names  # the parameters' names in the model, for messages
        self.layout = layout
        self.storage = storage
        self.reduction = reduction
        self.overlap = overlap
        if in_place and overlap:
            raise ValueError("in-place gradients launch nothing during backward: no overlap")
        self.in_place = in_place
        if batched and in_place:
            raise ValueError("in-place gradients are written by autograd: nothing to batch")
        self.batched = batched
        # In place: this backward goes the hooks' way (begin_backward), and after it each
        # param.grad is not its place in the buffer (only where reductions land in that
        # buffer: stages 0-1).
        self.later_round = False
        self.buckets = [Bucket(b) for b in layout.buckets]
        self.reducing = False  # whether the current backward reduces
        self._order = self.buckets  # the buckets it reduces, in index order
        self._scope: frozenset[int] | None = None
        self._next_launch = 0  # position in _order: buckets launch strictly in index order
        self.last_timing: BackwardTiming | None = None  # of the last reducing backward
        # Told the index of each part of a bucket (``BucketLayout.parts``) as the bucket's
        # reduction lands in the storage (offloaded gradients are copied to the host from
        # there while backward goes on).
        self.on_delivered: list[Callable[[int], None]] = []
        self._got_grad = [False] * len(params)
        self._part_of = layout.slot_parts()  # per slot, its part of its bucket (``batched``)
        self._said_held_back = False
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(slot))
            for slot, p in enumerate(params)
            if not in_place
        ]

    def _make_hook(self, slot: int):
        def hook(param: torch.Tensor) -> None:
            self._on_grad(slot, param)

        return hook

    def begin_cycle(self) -> None:
        """Start an accumulation cycle: gradients from zero."""
        self._got_grad = [False] * len(self.params)  # in this cycle, by slot
        self.storage.begin_cycle()
        for bucket in self.buckets:
            bucket.delivered = False

    def begin_backward(self, reduce: bool, scope: frozenset[int] | None = None) -> None:
        """``scope``: the indices of the buckets a reducing backward reduces (None: all).
        Every parameter's ``.grad`` is set: to its place in the storage when gradients
        accumulate in place, else to None (the hooks move each gradient to the storage)."""
        # In place, a backward after one that reduced in this cycle (before step()) cannot
        # add into a buffer that holds the reduction now (stages 0-1): its gradients go to
        # autograd's own tensors and, after it, through the hooks' path (a later round,
        # reduced apart and added).
        self.later_round = (
            self.in_place
            and self.storage.reduces_in_place
            and any(b.delivered for b in self.buckets)
        )
        if self.in_place and not self.later_round:
            self.storage.start_in_place()
            places = self.storage.grad_places(self.params)
            for param, place in zip(self.params, places, strict=True):
                param.grad = place
        else:
            for param in self.params:
                param.grad = None
        self.reducing = reduce
        self._order = (
            self.buckets if scope is None else [b for b in self.buckets if b.index in scope]
        )
        self._scope = scope
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.reset()

    def _on_grad(self, slot: int, param: torch.Tensor) -> None:
        self._got_grad[slot] = True
        grad = param.grad
        param.grad = None  # the storage holds it from here; autograd's tensor is freed
        bucket = self.buckets[self.layout.slots[slot].bucket]
        if not self.reducing:
            self.storage.write(bucket, slot, grad)
            return
        if self._scope is not None and bucket.index not in self._scope:
            raise RuntimeError(
                f"a parameter {self._named(slot)} got a gradient in a backward that "
                f"reduces only buckets {sorted(self._scope)}, not its bucket {bucket.index}: "
                "a pipeline backward that reaches part of a stage (a virtual stage's chunk, "
                "ZB-H1's input-gradient half) must find every parameter it reaches among that "
                "part's (a layer of one chunk using another chunk's parameter breaks this)"
            )
        if bucket.state in (BucketState.REDUCING, BucketState.REDUCED):
            self._finish(bucket)
            bucket.refill_late(slot)
        elif self.batched and bucket.state != BucketState.READY:  # the bucket's first round
            part = self._part_of[slot]
            bucket.held.setdefault(part, []).append((slot, grad))
            due = bucket.parts_pending[part]
            due.discard(slot)
            if not due:
                # The bucket's last part is written before the bucket is READY: making room
                # for it may launch the READY buckets (without overlap_comm), and it must not
                # go out without them.
                self._write_held(bucket, part)
            if bucket.mark_ready(slot) and self.overlap:
                self._launch_ready()
            return
        self._make_room(bucket)
        self.storage.write(bucket, slot, grad)
        if bucket.mark_ready(slot) and self.overlap:
            self._launch_ready()

    def _make_room(self, bucket: Bucket) -> None:
        """Before ``bucket`` takes a buffer: one free, if the storage's pool is used up."""
        if bucket.buffer is None and not self.storage.has_free_buffer():
            self._finish_oldest()  # bounds the memory held by buckets in flight
            if not self.storage.has_free_buffer():
                self._say_held_back()

    def _write_held(self, bucket: Bucket, part: int) -> None:
        """``batched``: the gradients ``bucket`` holds for ``part`` go into its buffer
        together."""
        held = bucket.held.pop(part, None)
        if held:
            self._make_room(bucket)
            self.storage.write_all(bucket, held)

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._order):
            bucket = self._order[self._next_launch]
            if bucket.state != BucketState.READY:
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        buffer = self.storage.buffer_for(bucket)
        bucket.handle, bucket.finalize = self.reduction.launch(bucket, buffer)
        bucket.move(BucketState.REDUCING)

    def _finish_oldest(self) -> None:
        """Free a bucket buffer: finish the oldest reduction in flight. Without
        ``overlap_comm`` none is: the buckets that are ready are reduced now, in order, and
        waited for (as DeepSpeed reduces a full bucket when overlap is off); otherwise every
        bucket of the model would hold a buffer until the end of backward, the size of the
        whole gradient."""
        if not self.overlap:
            self._launch_ready()
            for bucket in self.buckets:
                self._finish(bucket)
            return
        for bucket in self.buckets:
            if bucket.state == BucketState.REDUCING:
                self._finish(bucket)
                return

    def _say_held_back(self) -> None:
        """Once: the pool of bucket buffers grows, because the bucket next in order still
        waits for a gradient while later ones are complete (a parameter used late in backward,
        or unused). Every rank reduces the buckets in the same order, so they wait for it."""
        if self._said_held_back:
            return
        self._said_held_back = True
        order = self._order[self._next_launch :]
        waiting = next((b for b in order if b.state != BucketState.READY), None)
        if waiting is None:  # nothing held back: the pool is in use by reductions in flight
            return
        named = ", ".join(self._named(slot) for slot in sorted(waiting.pending)[:3])
        more = f" and {len(waiting.pending) - 3} more" if len(waiting.pending) > 3 else ""
        logger.warning(
            f"ZeRO: gradient bucket {waiting.index} still waits for the gradients of parameters "
            f"{named}{more} while buckets after it are complete; buckets are reduced in order "
            "on every rank, so those keep their buffers until it is, beyond the pool "
            f"of {self.storage.max_buffers} (up to the whole gradient if they never come: "
            "set requires_grad=False on a parameter that backward never reaches)"
        )

    def _named(self, slot: int) -> str:
        param = self.params[slot]
        shape = tuple(getattr(param, "ds_shape", param.shape))  # stage 3's: while released
        if self.names is None:
            return f"of shape {shape}"
        return f"'{self.names[slot]}' (shape {shape})"

    def _finish(self, bucket: Bucket) -> None:
        if bucket.state != BucketState.REDUCING:
            return
        bucket.handle.wait()
        reduced, start, end = bucket.finalize()
        self.storage.deliver(bucket, reduced, start, end)
        bucket.handle = bucket.finalize = None
        bucket.move(BucketState.REDUCED)
        for listener in self.on_delivered:
            for part in bucket.layout.parts():
                listener(part.index)

    def _gather_in_place(self) -> None:
        """In place, after autograd: a ``.grad`` that is no longer its place (a backward with
        ``create_graph`` accumulates out of place, or the caller replaced it) holds the sum
        so far; it is copied to its place, which it then is again. A later round's
        gradients (``begin_backward``) take the hooks' path now, one parameter after another,
        as a hook would have at each."""
        if self.later_round:
            for slot, param in enumerate(self.params):
                if param.grad is not None:
                    self._on_grad(slot, param)
            return
        for param, place in zip(self.params, self.storage.grad_places(self.params), strict=True):
            grad = param.grad
            if grad is not place:
                if grad is not None:
                    place.copy_(grad.detach())
                param.grad = place

    def finish_backward(self) -> list[torch.nn.Parameter]:
        """Wait for every reduction of this backward; when it reduced (the end of an
        accumulation cycle), returns the parameters that got no gradient in the whole cycle
        (they contributed zeros; in place, where no hook saw them, none is named)."""
        if self.in_place:
            self._gather_in_place()
        if not self.reducing:
            return []
        compute_end = time.perf_counter()
        first_round = self._next_launch
        for bucket in self._order[first_round:]:
            if bucket.state != BucketState.READY:
                for part in list(bucket.held):
                    self._write_held(bucket, part)
                bucket.pending.clear()  # parameters without a gradient contribute zeros
                bucket.move(BucketState.READY, "(flushed at the end of backward)")
        self._launch_ready()
        for bucket in self._order:
            self._finish(bucket)
        # Late gradients: buckets refilled after their round, reduced again in index order.
        late = [b for b in self._order[:first_round] if b.state != BucketState.REDUCED]
        for bucket in late:
            if bucket.state == BucketState.FILLING:
                bucket.move(BucketState.READY)
            self._launch(bucket)
        for bucket in late:
            self._finish(bucket)
        self.last_timing = BackwardTiming(compute_end, time.perf_counter() - compute_end)
        if self.in_place:
            return []
        return [p for p, got in zip(self.params, self._got_grad, strict=True) if not got]

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
