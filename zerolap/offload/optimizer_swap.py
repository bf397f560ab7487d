"""Swapped sub-groups: the optimizer state (and fp32 master values) of ``offload_optimizer: {device:
nvme}``, in one swap file per rank, streamed through ``buffer_count`` buffers.

Each swapped sub-group (``zero.sub_groups``) owns one region of the file: its *fields* one after
another (``master``, the fp32 values, under mixed precision; then every per-element state tensor
the optimizer keeps, such as Adam's ``exp_avg`` and ``exp_avg_sq``), each field holding the
sub-group's runs back to back. A buffer holds one region; while a sub-group is *open* its runs'
fields are typed views into its buffer.

Buffers and lanes. Sub-group ``k`` always uses buffer ``k % B`` and that buffer's *lane*, one I/O
thread that runs, in order, everything done to it: so a buffer is read into only after its
previous contents were written out, and a sub-group's own read always follows its last write,
with no locks. One pass of the optimizer (``open`` / ``close`` in sub-group order) keeps the
other ``B - 1`` lanes reading ahead while the current sub-group steps, and writes the previous
ones back behind it. ``prefetch`` starts the first ``B`` reads early (the engine calls it when
the backward that ends an accumulation cycle begins: the state does not depend on gradients),
and the last writes of a pass finish in the background, under the next forward; anything that
must see the file consistent (a checkpoint, ``close_file``) waits for them first.

A region never written holds nothing: its sub-group opens *fresh* (no state yet; the optimizer
creates it on its first step). The master values are written at construction, so only state can
be fresh. An I/O error, a file cut short or a checksum mismatch is a ``SwapError``; from then on
every use raises it again, so that a half-done step is never stepped on or checkpointed.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from zerolap.offload.swap_file import SwapError, SwapFile, aligned, aligned_empty
from zerolap.zero.sub_groups import SubGroup

__all__ = ["Field", "OpenSubGroup", "SwappedState"]

_FIELD_ALIGN = 64  # bytes: every field starts where any dtype's view may begin


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class _Region:
    offset: int  # in the file, a multiple of swap_file.ALIGN
    nbytes: int
    field_offsets: tuple[int, ...]  # byte offset of each field inside the region


@dataclass
class OpenSubGroup:
    """A sub-group in its buffer: for each of its runs, the typed view of every field."""

    sub_group: SubGroup
    fields: list[dict[str, torch.Tensor]]  # one dict per run of the sub-group, in order
    fresh: bool  # nothing was ever written: the state fields hold no state yet


class SwappedState:
    def __init__(
        self,
        *,
        path: Path,
        sub_groups: list[SubGroup],
        run_numels: list[int],
        fields: list[Field],
        buffer_count: int,
        pipeline_read: bool = True,
        pipeline_write: bool = True,
        pin: bool = False,
    ) -> None:
        if buffer_count < 1:
            raise ValueError(
                f"offload_optimizer.buffer_count must be at least 1, got {buffer_count}"
            )
        self.sub_groups = sub_groups
        self.run_numels = run_numels
        self.fields = fields
        self.pipeline_read = pipeline_read
        self.pipeline_write = pipeline_write
        self._regions = self._lay_out()
        self.file = SwapFile(path, sum(r.nbytes for r in self._regions))
        count = min(buffer_count, len(sub_groups))
        largest = max((r.nbytes for r in self._regions), default=0)
        self.buffers = [aligned_empty(largest, pin=pin) for _ in range(count)]
        self._lanes = [
            ThreadPoolExecutor(1, thread_name_prefix="zerolap-swap") for _ in range(count)
        ]
        self._pending: list[Future | None] = [None] * count  # last operation on each lane
        self._reads: dict[int, Future] = {}  # position -> its read, started and not yet used
        self.stateful = [False] * len(sub_groups)  # the optimizer's state was written there
        self.broken: SwapError | None = None

    # -- layout -------------------------------------------------------------------------------

    def _lay_out(self) -> list[_Region]:
        regions, offset = [], 0
        for sg in self.sub_groups:
            field_offsets, at = [], 0
            for field in self.fields:
                field_offsets.append(at)
                at += -(-sg.numel * field.itemsize // _FIELD_ALIGN) * _FIELD_ALIGN
            regions.append(_Region(offset, at, tuple(field_offsets)))
            offset += aligned(at)
        return regions

    def _views(self, position: int) -> list[dict[str, torch.Tensor]]:
        sg, region = self.sub_groups[position], self._regions[position]
        buffer = self.buffers[position % len(self.buffers)]
        out = [{} for _ in sg.runs]
        for field, at in zip(self.fields, region.field_offsets, strict=True):
            typed = buffer[at : at + sg.numel * field.itemsize].view(field.dtype)
            start = 0
            for k, run in enumerate(sg.runs):
                numel = self.run_numels[run]
                out[k][field.name] = typed[start : start + numel]
                start += numel
        return out

    # -- lanes ----------------------------------------------------------------------------------

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken

    def _wait(self, future: Future | None):
        if future is None:
            return None
        try:
            return future.result()
        except SwapError as err:
            self.broken = err
            raise

    def _submit(self, position: int, operation) -> Future:
        lane = position % len(self.buffers)
        future = self._lanes[lane].submit(operation)
        self._pending[lane] = future
        return future

    def _start_read(self, position: int) -> None:
        if position >= len(self.sub_groups) or position in self._reads:
            return
        region = self._regions[position]
        buffer = self.buffers[position % len(self.buffers)]

        def read() -> None:
            # Decided on the lane, after the region's last write: a region never written
            # (fresh state, no master) has nothing to read.
            if self.file.written(region.offset):
                self.file.read(region.offset, buffer, region.nbytes)

        self._reads[position] = self._submit(position, read)

    def _start_write(self, position: int) -> None:
        region = self._regions[position]
        buffer = self.buffers[position % len(self.buffers)]
        future = self._submit(
            position, lambda: self.file.write(region.offset, buffer, region.nbytes)
        )
        if not self.pipeline_write:
            self._wait(future)

    # -- the optimizer's pass ---------------------------------------------------------------------

    def prefetch(self) -> None:
        """Start reading the first sub-groups of the next pass, one per buffer."""
        self._check()
        if self.pipeline_read:
            for position in range(len(self.buffers)):
                self._start_read(position)

    def begin_pass(self) -> None:
        """Before the first ``open`` of a pass: the file must still be whole."""
        self._check()
        self.file.check_size()

    def open(self, position: int) -> OpenSubGroup:
        """The ``position``-th swapped sub-group, read into its buffer (waits for the read)."""
        self._check()
        self._start_read(position)
        self._wait(self._reads.pop(position))
        fresh = not self.stateful[position]
        return OpenSubGroup(self.sub_groups[position], self._views(position), fresh)

    def close(self, position: int, *, stateful: bool) -> None:
        """Write the sub-group back (``stateful``: its state fields now hold the optimizer's
        state), and start reading the one that takes its buffer next."""
        self.stateful[position] = stateful
        self._start_write(position)
        if self.pipeline_read:
            self._start_read(position + len(self.buffers))

    def visit(self, positions: list[int]) -> Iterator[OpenSubGroup]:
        """A pass outside the step (checkpoints, loads, state dicts): the sub-groups at
        ``positions`` (ascending) opened in turn; the caller ``close``s those it changed. The
        lanes are idle after."""
        self.begin_pass()
        self.drain()
        try:
            for position in positions:
                yield self.open(position)
        finally:
            self.drain()

    def drain(self) -> None:
        """Wait for every lane (pending reads are dropped: their buffers may be reused)."""
        for future in self._pending:
            self._wait(future)
        self._reads.clear()

    # -- accounting and teardown ------------------------------------------------------------------

    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def file_bytes(self) -> int:
        return self.file.nbytes

    def close_file(self) -> None:
        """Wait for the lanes, stop their threads, remove the file."""
        try:
            for future in self._pending:
                if future is not None:
                    future.exception()
        finally:
            for lane in self._lanes:
                lane.shutdown(wait=True)
            self.file.close()
