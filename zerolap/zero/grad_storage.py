"""Where gradients accumulate, and which tensor each bucket hands to its collective.

Two kinds, chosen once per ZeRO stage:

* ``FullGradients`` (stages 0 and 1): one flat buffer of every gradient, the size of the model.
  Gradients of several micro-batches accumulate in it locally and the buffer's own bucket regions
  are reduced in place at the accumulation boundary (through a cast copy when the communication
  dtype differs).
* ``ShardGradients`` (stages 2 and 3): only this rank's shard is kept. Each bucket collects its
  gradients in a buffer from a small pool, reduce-scattered every micro-batch; the owned chunk is
  copied into the shard (the cycle's first round) or added to it, and the buffer goes back to
  the pool. Memory for the other ranks' gradients is a few bucket buffers, whatever the
  model's size, while the buckets complete in order (the reducer reduces them in order, so
  one still waiting for a gradient keeps the complete ones after it, each in its buffer).
  With in-place gradients (``GradReducer``'s ``in_place``) there is no pool: one buffer of
  every bucket, kept, where the pool would hold as much.

  With optimizer offload from an accelerator, the shard's tail (the elements the host
  steps) lives in host memory (``place_on_host``): each reduced chunk is copied down as it is
  delivered, on a side stream, so the device keeps no gradient of those elements past their
  reduction. A later round's chunk (accumulation) goes down into a pinned staging buffer and a
  host thread adds it once it has arrived (``offload.host.HostAdditions``): backward waits
  only when two are still staged.

Rules both follow:
* Every gradient is multiplied by the reduction's pre factor (``reductions.scale_factors``) as
  it is written. The first gradient written to a place in a round is copied (multiplied into
  place), later ones are added, so nothing is zeroed up front; places that got no gradient
  (unused parameters, padding) are zeroed just before the bucket is launched. The same holds
  where the cycle's sum is kept (stages 2-3's shard): a bucket's first round is copied there,
  and places no round reached are zeroed when something first reads them (``settle``).
  In place, where autograd adds every gradient into the buffer itself, that buffer is zeroed
  up front instead (``start_in_place``).
* The first round of a bucket in an accumulation cycle may reduce in place; any later round (a
  second backward before ``step()``, a late gradient) reduces only the new gradients in a fresh
  zeroed buffer and *adds* the result.
"""

from __future__ import annotations

import torch

from zerolap.zero.bucket import Bucket
from zerolap.zero.layout import BucketLayout, FlatLayout

__all__ = ["FullGradients", "ShardGradients"]


def _slot_range(layout: FlatLayout, slot: int) -> tuple[int, int]:
    place = layout.slots[slot]
    return place.offset, place.offset + place.numel


def _padding(layout: FlatLayout, bucket) -> list[tuple[int, int]]:
    """``(buffer position, count)`` of the elements of ``bucket``'s buffer that no parameter
    fills: each part's padding to a multiple of the ranks."""
    gaps = []
    for part in bucket.parts():
        last = layout.slots[part.slots[-1]]
        end = last.offset + last.numel
        gaps += [(at, count) for at, _, count in bucket.places(end, part.end - end) if count]
    return gaps


def _views(buffer: torch.Tensor, layout: FlatLayout, params) -> list[torch.Tensor]:
    """Each parameter's place in ``buffer`` (laid out as ``layout``), shaped as the parameter."""
    return [
        buffer[slot.offset : slot.offset + slot.numel].view_as(param)
        for slot, param in zip(layout.slots, params, strict=True)
    ]


def _put(place: torch.Tensor, grad: torch.Tensor, factor: float, *, first: bool) -> None:
    """``place`` := (first) or += ``grad`` times ``factor``, computed in ``place``'s dtype
    (one pass when the dtypes agree)."""
    flat = grad.reshape(-1)
    if first:
        if factor == 1.0:
            place.copy_(flat)
        elif place.dtype == flat.dtype:
            torch.mul(flat, factor, out=place)
        else:  # torch.mul would multiply in the gradient's (narrower) dtype, then cast
            place.copy_(flat).mul_(factor)
    else:
        place.add_(flat, alpha=factor)


def _put_all(places: list[torch.Tensor], grads: list[torch.Tensor], factor: float) -> None:
    """``_put`` of each ``grads[i]`` into ``places[i]``, first in its place, in one multi-tensor
    copy (and multiply): one kernel for a module's gradients on an accelerator, where one
    per gradient costs the host a launch each."""
    flats = [grad.reshape(-1) for grad in grads]
    if factor != 1.0 and places[0].dtype != torch.float32:
        # torch's multi-tensor multiply does not round a 16-bit product as ``_put``'s does.
        for place, flat in zip(places, flats, strict=True):
            _put(place, flat, factor, first=True)
        return
    torch._foreach_copy_(places, flats)
    if factor != 1.0:
        torch._foreach_mul_(places, factor)


class FullGradients:
    # A bucket's reduction lands in the buffer its gradients were accumulated in: a backward
    # after it in the same cycle cannot accumulate there in place (``GradReducer``).
    reduces_in_place = True

    def __init__(
        self,
        layout: FlatLayout,
        *,
        dtype: torch.dtype,
        comm_dtype: torch.dtype,
        device,
        pre: float = 1.0,
    ) -> None:
        self.layout = layout
        self.comm_dtype = comm_dtype
        self.pre = pre  # every gradient is multiplied by it as it is written
        self.flat = torch.zeros(layout.numel, dtype=dtype, device=device)
        self.unwritten = set(range(len(layout.slots)))  # slots with no gradient this cycle
        self._places: list[torch.Tensor] = []  # grad_places, views of _places_of
        self._places_of: torch.Tensor | None = None

    def has_free_buffer(self) -> bool:
        return True  # reduces in place

    def _later_buffer(self, bucket: Bucket) -> torch.Tensor:
        """A later round's own buffer for ``bucket``, zeroed when the round first needs it."""
        if bucket.buffer is None:
            bucket.buffer = torch.zeros(
                bucket.layout.numel, dtype=self.comm_dtype, device=self.flat.device
            )
        return bucket.buffer

    def write(self, bucket: Bucket, slot: int, grad: torch.Tensor) -> None:
        start, end = _slot_range(self.layout, slot)
        if bucket.delivered:
            offset = bucket.layout.start
            place = self._later_buffer(bucket)[start - offset : end - offset]
            _put(place, grad, self.pre, first=False)
        else:
            _put(self.flat[start:end], grad, self.pre, first=slot in self.unwritten)
            self.unwritten.discard(slot)

    def zero_unwritten(self, slots) -> None:
        for slot in self.unwritten.intersection(slots):
            start, end = _slot_range(self.layout, slot)
            self.flat[start:end].zero_()
        self.unwritten.difference_update(slots)

    def buffer_for(self, bucket: Bucket) -> torch.Tensor:
        if bucket.delivered:  # zeros if no gradient reached it in this round: every rank
            return self._later_buffer(bucket)  # reduces every bucket, whatever it got
        self.zero_unwritten(bucket.layout.slots)
        region = self.flat[bucket.layout.start : bucket.layout.end]
        bucket.buffer = region if region.dtype == self.comm_dtype else region.to(self.comm_dtype)
        return bucket.buffer

    def deliver(self, bucket: Bucket, reduced: torch.Tensor, start: int, end: int) -> None:
        """``reduced`` holds the reduction of flat ``[start, end)``."""
        target = self.flat[start:end]
        if bucket.delivered:
            target.add_(reduced)
        elif reduced.data_ptr() != target.data_ptr():
            target.copy_(reduced)
        bucket.delivered = True
        bucket.buffer = None

    def view(self, start: int, end: int, shard_pos: int) -> torch.Tensor:
        """Gradients of flat ``[start, end)`` (``shard_pos`` is unused: the buffer is flat)."""
        return self.flat[start:end]

    def parts(self, start: int, end: int, shard_pos: int) -> list[torch.Tensor]:
        return [self.flat[start:end]]

    def place_on_host(self, position: int, plan) -> bool:
        """Every gradient is kept where training runs (stages 0-1 reduce them in place)."""
        return False

    def close(self) -> None:
        """Nothing runs apart from the caller."""

    def param_grad(self, slot: int) -> torch.Tensor:
        start, end = _slot_range(self.layout, slot)
        return self.flat[start:end]

    def begin_cycle(self) -> None:
        self.unwritten = set(range(len(self.layout.slots)))

    def grad_places(self, params) -> list[torch.Tensor]:
        """Each parameter's ``.grad`` when gradients go in place (``GradReducer``'s
        ``in_place``): its place in the flat buffer (views of its storage: ``offload_states``
        moves that storage's contents, and the views follow)."""
        if self._places_of is not self.flat:
            self._places, self._places_of = _views(self.flat, self.layout, params), self.flat
        return self._places

    @property
    def in_place_dtype(self) -> torch.dtype:
        return self.flat.dtype

    def in_place_costs_no_memory(self) -> bool:
        return True  # the flat buffer is there either way

    def start_in_place(self) -> None:
        """Before a backward that accumulates in place: the cycle's first starts from zeros
        (no place is then left to zero later); the next ones add to its sums."""
        if self.unwritten:
            self.flat.zero_()
            self.unwritten = set()

    def settle(self) -> None:
        """Before the optimizer reads: places no micro-batch wrote hold zero."""
        self.zero_unwritten(range(len(self.layout.slots)))

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def host_bytes(self) -> int:
        return 0

    def buffer_bytes(self) -> int:
        return 0  # buckets are regions of the flat buffer

    def device_tensors(self) -> list[torch.Tensor]:
        """The gradients' memory (``offload_states``' lp_grads)."""
        return [self.flat]

    def drop_buffers(self) -> None:
        """Nothing to drop: buckets are regions of the flat buffer."""


class ShardGradients:
    # A bucket's reduction lands in the shard: every backward may accumulate in place.
    reduces_in_place = False

    def __init__(
        self,
        layout: FlatLayout,
        rank: int,
        *,
        dtype: torch.dtype,
        comm_dtype: torch.dtype,
        device,
        pre: float = 1.0,
        max_buffers: int = 4,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.comm_dtype = comm_dtype
        self.pre = pre  # every gradient is multiplied by it as it is written
        self.device = device
        self.shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
        self._shard_offsets = [layout.shard_offset(b.index) for b in layout.buckets]
        self._buffer_numel = max((b.numel for b in layout.buckets), default=0)
        # Pooled buffers of _buffer_numel elements, each with the event a copy from it must
        # reach before the buffer is written again (None: nothing reads it).
        self._free: list[tuple[torch.Tensor, object]] = []
        self.host_from = layout.shard_numel  # shard positions from here on live on the host
        self.host_shard: torch.Tensor | None = None
        self._stream = None  # the side stream of the copies down (CUDA)
        self._later = None  # later rounds' additions into the host part (HostAdditions)
        self._host_written: set[int] = set()  # buckets whose host part holds this cycle's sum
        self._written: set[int] = set()  # buckets whose device part holds this cycle's sum
        self._allocated = 0
        self.max_buffers = max_buffers  # beyond this, the reducer finishes a bucket first
        self._unwritten: dict[int, set[int]] = {}  # per bucket holding a buffer
        # Where each slot's gradient goes in its bucket's buffer, and which parts of each
        # buffer no parameter fills, as (buffer position, position in the gradient, count):
        # one run each but in a coalesced bucket (stage 3), whose buffer is laid out rank by
        # rank (``BucketLayout.places``).
        self._slot_places = [
            layout.buckets[s.bucket].places(s.offset, s.numel) for s in layout.slots
        ]
        self._padding = [_padding(layout, bucket) for bucket in layout.buckets]
        # Each slot's part of its bucket, where each bucket's parts start in its rows, and the
        # staging buffer members of coalesced buckets may go through.
        self._part_of = layout.slot_parts()
        self._columns = [bucket.columns() for bucket in layout.buckets]
        self._staging: torch.Tensor | None = None
        # With gradients in place (``start_in_place``): one buffer of every bucket, laid out
        # as ``layout``, instead of the pool, and each parameter's place in it (None until
        # the first backward, or after ``drop_buffers``).
        self._in_place = False
        self._in_place_flat: torch.Tensor | None = None
        self._places: list[torch.Tensor] | None = None

    def has_free_buffer(self) -> bool:
        return bool(self._free) or self._allocated < self.max_buffers

    @property
    def in_place_dtype(self) -> torch.dtype:
        return self.comm_dtype  # the buckets' buffers are what the reductions send

    def in_place_costs_no_memory(self) -> bool:
        """Whether one buffer of every bucket (gradients in place) is no larger than the
        pooled buffers the hooks' path holds from its first backward on: as many as there are
        buckets, up to the pool's size, each of the largest bucket's size."""
        buckets = len(self.layout.buckets)
        return self.layout.numel <= min(buckets, self.max_buffers) * self._buffer_numel

    def start_in_place(self) -> None:
        """Before a backward that accumulates in place (``GradReducer``'s ``in_place``):
        every bucket's buffer starts from zeros (its last round was delivered to the shard),
        padding included."""
        self._in_place = True
        if self._in_place_flat is None:
            self._in_place_flat = torch.empty(
                self.layout.numel, dtype=self.comm_dtype, device=self.device
            )
        self._in_place_flat.zero_()

    def grad_places(self, params) -> list[torch.Tensor]:
        """Each parameter's ``.grad`` when gradients go in place: its place in its bucket's
        buffer (after ``start_in_place``)."""
        if self._places is None:
            self._places = _views(self._in_place_flat, self.layout, params)
        return self._places

    def place_on_host(self, position: int, plan) -> bool:
        """Keep the shard's elements from ``position`` on in host memory (``plan``: the
        offload's ``HostPlan``); the device keeps the rest."""
        self.host_from = position
        self.host_shard = plan.empty(self.layout.shard_numel - position, self.shard.dtype)
        self.shard = self.shard.new_zeros(position)  # the tail's device memory is freed
        if plan.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=plan.device)
        largest = max((b.chunk_numel for b in self.layout.buckets), default=0)
        self._later = plan.additions(self._stream, self.comm_dtype, largest)
        return True

    def _acquire(self, bucket: Bucket) -> torch.Tensor:
        if self._free:
            full, copied = self._free.pop(0)  # the oldest: its copy down is the likeliest done
            if copied is not None:  # a copy down may still be reading it
                torch.cuda.current_stream(full.device).wait_event(copied)
        else:
            # Zeroed once, so that all its pages are resident from the start: the memory a run
            # holds does not then depend on which buckets happened to take which buffer (a
            # small bucket touches a few pages of a buffer sized for the largest).
            full = torch.zeros(self._buffer_numel, dtype=self.comm_dtype, device=self.device)
            self._allocated += 1
        self._unwritten[bucket.index] = set(bucket.layout.slots)
        return full[: bucket.layout.numel]

    def _pieces(self, buffer: torch.Tensor, slot: int, grad: torch.Tensor):
        """(place in ``buffer``, the part of ``grad`` that goes there) for ``slot``."""
        places = self._slot_places[slot]
        if len(places) == 1:
            at, _, count = places[0]
            return [(buffer[at : at + count], grad)]
        flat = grad.reshape(-1)
        return [(buffer[at : at + count], flat[i : i + count]) for at, i, count in places]

    def write(self, bucket: Bucket, slot: int, grad: torch.Tensor) -> None:
        if bucket.buffer is None:
            bucket.buffer = self._acquire(bucket)
        unwritten = self._unwritten[bucket.index]
        first = slot in unwritten
        for place, piece in self._pieces(bucket.buffer, slot, grad):
            _put(place, piece, self.pre, first=first)
        unwritten.discard(slot)

    def write_all(self, bucket: Bucket, grads: list[tuple[int, torch.Tensor]]) -> None:
        """``write`` of each (slot, gradient) in order, the first of each slot in one
        multi-tensor copy (``GradReducer``'s ``batched``)."""
        if bucket.buffer is None:
            bucket.buffer = self._acquire(bucket)
        unwritten = self._unwritten[bucket.index]
        firsts, later = [], []
        for slot, grad in grads:
            if slot in unwritten:
                unwritten.discard(slot)
                firsts.append((slot, grad))
            else:  # a slot's second gradient (reached twice: reentrant checkpoints)
                later.append((slot, grad))
        index = self._staged_part(bucket, firsts)
        if index is not None:
            # Written as the member lies in the flat layout, then moved to its rows at once.
            part = bucket.layout.parts()[index]
            staging = self._staging_for(part)
            places = [
                staging[place.offset - part.start : place.offset - part.start + place.numel]
                for place in (self.layout.slots[slot] for slot, _ in firsts)
            ]
            _put_all(places, [grad for _, grad in firsts], self.pre)
            rows = bucket.buffer.view(self.layout.world_size, -1)
            column = self._columns[bucket.index][index]
            rows[:, column : column + part.chunk_numel].copy_(staging.view(rows.shape[0], -1))
        elif firsts:
            pieces = [p for slot, grad in firsts for p in self._pieces(bucket.buffer, slot, grad)]
            _put_all([place for place, _ in pieces], [piece for _, piece in pieces], self.pre)
        for slot, grad in later:
            self.write(bucket, slot, grad)

    def _staged_part(self, bucket: Bucket, firsts: list) -> int | None:
        """Which member of a coalesced bucket ``firsts`` fill whole, when writing it through
        the staging buffer beats writing it in pieces: over more than 2 ranks a parameter is
        cut at every chunk boundary it spans, up to one piece per rank, where staged it is
        one place in the member's flat order and the member one strided copy into the
        buffer's rows (any other write goes in pieces: a strided copy of a member written in
        part would overwrite what the rest of it holds)."""
        parts = bucket.layout.parts()
        if self.layout.world_size <= 2 or not firsts or len(parts) == 1:
            return None
        index = self._part_of[firsts[0][0]]
        return index if len(firsts) == len(parts[index].slots) else None

    def _staging_for(self, part: BucketLayout) -> torch.Tensor:
        """A buffer of ``part``'s size (the largest member's, kept for the next)."""
        if self._staging is None or self._staging.numel() < part.numel:
            self._staging = torch.empty(part.numel, dtype=self.comm_dtype, device=self.device)
        return self._staging[: part.numel]

    def buffer_for(self, bucket: Bucket) -> torch.Tensor:
        if self._in_place:  # zeroed before the backward: unwritten places and padding too
            bucket.buffer = self._in_place_flat[bucket.layout.start : bucket.layout.end]
            return bucket.buffer
        if bucket.buffer is None:  # no gradient arrived this round: contribute zeros
            bucket.buffer = self._acquire(bucket)
        buffer = bucket.buffer
        unwritten = self._unwritten.pop(bucket.index)
        gaps = [(at, count) for slot in unwritten for at, _, count in self._slot_places[slot]]
        for at, count in gaps + self._padding[bucket.index]:
            buffer[at : at + count].zero_()
        return buffer

    def deliver(self, bucket: Bucket, reduced: torch.Tensor, start: int, end: int) -> None:
        chunk_start, chunk_end = bucket.layout.chunk(self.rank)
        piece = reduced[chunk_start - start : chunk_end - start]
        offset = self._shard_offsets[bucket.index]
        on_device = min(max(self.host_from - offset, 0), piece.numel())
        if on_device:
            target = self.shard[offset : offset + on_device]
            if bucket.index in self._written:
                target.add_(piece[:on_device])
            else:  # the cycle's first round: copied, so the shard is never zeroed up front
                target.copy_(piece[:on_device])
                self._written.add(bucket.index)
        buffer = bucket.buffer._base if bucket.buffer._base is not None else bucket.buffer
        copied = None
        if on_device < piece.numel():
            copied = self._down(bucket.index, piece[on_device:], offset + on_device)
            if piece.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
                copied = None  # it reads a reduction's own output (kept by record_stream)
        bucket.delivered = True
        if not self._in_place:
            self._free.append((buffer, copied))
        bucket.buffer = None  # the other ranks' gradients are not kept past the reduction

    def _down(self, bucket: int, piece: torch.Tensor, position: int):
        """Shard ``position`` onwards (on the host) := (first round of the cycle) or +=
        ``piece``. Returns the event the copies down complete at (None if they are done)."""
        at = position - self.host_from
        target = self.host_shard[at : at + piece.numel()]
        if bucket in self._host_written:
            # A later round (accumulation, late gradients): added on the host, off backward.
            self._later.add(target, piece)
        else:
            self._host_written.add(bucket)
            if self._stream is None:
                target.copy_(piece)
            else:
                self._stream.wait_stream(torch.cuda.current_stream(piece.device))
                with torch.cuda.stream(self._stream):
                    target.copy_(piece, non_blocking=True)
        if self._stream is None:
            return None
        piece.record_stream(self._stream)  # its memory is not reused before the copy is done
        return self._stream.record_event()

    def _wait_copies(self) -> None:
        """Every copy down arrived and every addition made (an addition's error raised)."""
        if self._later is not None:
            self._later.wait()
        if self._stream is not None:
            self._stream.synchronize()

    def close(self) -> None:
        """The adding thread stopped (the optimizer is done)."""
        if self._later is not None:
            self._later.close()

    def view(self, start: int, end: int, shard_pos: int) -> torch.Tensor:
        """Gradients of flat ``[start, end)``, which sit at ``shard_pos`` in the shard (all on
        the device, or all on the host: see ``parts``)."""
        (part,) = self.parts(start, end, shard_pos)
        return part

    def parts(self, start: int, end: int, shard_pos: int) -> list[torch.Tensor]:
        """The same elements as one view per side of the host boundary they lie on."""
        numel, cut = end - start, self.host_from - shard_pos
        if cut >= numel:
            return [self.shard[shard_pos : shard_pos + numel]]
        host = self.host_shard[max(-cut, 0) : numel - cut]
        return [self.shard[shard_pos : self.host_from], host] if cut > 0 else [host]

    def param_grad(self, slot: int) -> None:
        return None  # a parameter's full gradient exists nowhere on this rank

    def begin_cycle(self) -> None:
        self._wait_copies()  # nothing of the last cycle lands in this one
        # Both parts are overwritten by each bucket's first round.
        self._written.clear()
        self._host_written.clear()

    def settle(self) -> None:
        """Before anything reads the gradients (the optimizer, ``safe_get_full_grad``): the
        copies down have arrived, and elements no reduction reached this cycle hold zero.
        The accessors settle once per parameter: with no host part, once every bucket is
        written this cycle (any full backward writes them all) it costs a comparison."""
        if self.host_shard is None and len(self._written) == len(self.layout.buckets):
            return
        self._wait_copies()
        for bucket in self.layout.buckets:
            offset = self._shard_offsets[bucket.index]
            end = offset + bucket.chunk_numel
            if bucket.index not in self._written and offset < self.host_from:
                self.shard[offset : min(end, self.host_from)].zero_()
                self._written.add(bucket.index)  # a later delivery adds onto the zeros
            if bucket.index not in self._host_written and end > self.host_from:
                lo = max(offset - self.host_from, 0)
                self.host_shard[lo : end - self.host_from].zero_()
                self._host_written.add(bucket.index)

    def nbytes(self) -> int:
        """Gradient memory where training runs (the host part is ``host_bytes``)."""
        return self.shard.numel() * self.shard.element_size()

    def host_bytes(self) -> int:
        if self.host_shard is None:
            return 0
        return self.host_shard.numel() * self.host_shard.element_size()

    def buffer_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.comm_dtype).element_size()
        flat = self._in_place_flat.numel() if self._in_place_flat is not None else 0
        staging = self._staging.numel() if self._staging is not None else 0
        return (self._allocated * self._buffer_numel + flat + staging) * itemsize

    def device_tensors(self) -> list[torch.Tensor]:
        """The gradient shard where training runs (``offload_states``' lp_grads)."""
        return [self.shard]

    def drop_buffers(self) -> None:
        """Free the bucket buffers reductions pass through that are free (``offload_states``'
        contiguous_grad_buffer); the next reductions allocate them again."""
        self._allocated -= len(self._free)  # one a raised backward never gave back stays counted
        self._free.clear()
        self._in_place_flat = self._places = None  # the next backward in place allocates it
        self._staging = None
