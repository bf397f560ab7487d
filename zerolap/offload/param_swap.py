"""Swapped parameter chunks: stage 3's shard on disk between uses (``offload_param: {device:
nvme}``).

Stage 3 keeps, per fetch unit, this rank's chunk of the unit's flat parameters (``zero.
sharded_params``). With ``offload_param`` on nvme the chunks of the units chosen here (those past
``max_in_cpu`` elements) live in one swap file per rank, a region per unit, and come into memory
only to be used: copied into the unit's full buffer by its all-gather (forward, backward,
after a step for anything gathered again), updated by the optimizer step, read and written by
checkpoints.

A chunk in memory sits in one of ``buffer_count`` buffers of ``buffer_size`` elements: a small
cache, least recently used first out. A chunk that was changed is written back when its buffer
is taken for another, or by ``flush``; a chunk only read is dropped. So a forward (or backward)
reads each swapped chunk once, a step writes each once, and memory holds ``buffer_count``
buffers whatever the model's size.

A gather of a swapped unit (on gloo) does not wait for the disk on the thread that launches it:
``stage`` starts the chunk's read on the swap's I/O thread and pins its buffer, and the gather
copies the chunk in on the ring's own thread when its turn comes, then unpins it. So the
fetcher's prefetch launches gathers without waiting for reads, and the reads run under the
model's compute. It still waits to write back a changed chunk whose buffer it takes (the
first gathers after a step), and for a buffer when every one is pinned. A pinned buffer is never
taken for another chunk, nor written by a ``get``. A read that fails breaks the swap: that
``SwapError`` is raised by every later use, and no half-read chunk is ever served or written
back. Everything else (the optimizer's and checkpoints' ``get``, write-backs) is synchronous,
on the thread that asks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from zerolap.config import ConfigError
from zerolap.offload.swap_file import SwapError, SwapFile, aligned, aligned_empty, swap_path

__all__ = ["ParamSwapPlan", "SwappedChunks"]


class ParamSwapPlan:
    """``offload_param: {device: nvme}`` on one rank."""

    def __init__(
        self, *, directory: Path, rank: int, buffer_count: int, buffer_size: int, max_in_cpu: int
    ) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.buffer_count = buffer_count
        self.buffer_size = buffer_size
        self.max_in_cpu = max_in_cpu

    def choose(self, chunk_numels: list[int], persistent: list[bool]) -> list[int]:
        """The units whose chunks are swapped: past the first ``max_in_cpu`` elements of
        chunks, in unit order (units kept whole are never swapped: they are gathered always)."""
        kept, swapped = 0, []
        for unit, (numel, whole) in enumerate(zip(chunk_numels, persistent, strict=True)):
            if whole or numel == 0:
                continue
            if kept + numel <= self.max_in_cpu:
                kept += numel
            else:
                swapped.append(unit)
        return swapped

    def build(
        self, chunk_numels: dict[int, int], dtype: torch.dtype, names: dict[int, str]
    ) -> SwappedChunks:
        """``names``: a parameter of each unit, for the error about a chunk too large."""
        for unit, numel in chunk_numels.items():
            if numel > self.buffer_size:
                raise ConfigError(
                    f"zero_optimization.offload_param.buffer_size {self.buffer_size} is smaller "
                    f"than the {numel}-element shard of the unit holding {names[unit]}: raise "
                    "buffer_size (elements) to at least that"
                )
        return SwappedChunks(
            path=swap_path(self.directory, self.rank, "params"),
            chunk_numels=chunk_numels,
            dtype=dtype,
            buffer_count=self.buffer_count,
        )


class SwappedChunks:
    def __init__(
        self, *, path: Path, chunk_numels: dict[int, int], dtype: torch.dtype, buffer_count: int
    ) -> None:
        self.dtype = dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.nbytes = {unit: numel * itemsize for unit, numel in chunk_numels.items()}
        self.numel = dict(chunk_numels)
        self.offsets, offset = {}, 0
        for unit, nbytes in self.nbytes.items():
            self.offsets[unit] = offset
            offset += aligned(nbytes)
        self.file = SwapFile(path, offset)
        largest = max(self.nbytes.values(), default=0)
        self._size = largest
        self._count = min(buffer_count, len(chunk_numels))
        self._free: list[torch.Tensor] = []  # buffers allocated and holding nothing
        self._allocated = 0
        self._cached: OrderedDict[int, torch.Tensor] = OrderedDict()  # unit -> its buffer, LRU
        self._dirty: set[int] = set()
        self._reading: dict[int, Future] = {}  # reads started by ``stage``, not yet collected
        self.broken: SwapError | None = None  # a read failed: every later use raises it
        self._pins: dict[int, int] = {}  # unit -> gathers still to copy its chunk in
        self._unpinned = threading.Condition()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="zerolap-param-swap")
        self.reads = self.writes = 0  # chunks moved, since construction
        self.staged_reads = 0  # ... of the reads, those made on the I/O thread for a gather

    def __contains__(self, unit: int) -> bool:
        return unit in self.numel

    def get(self, unit: int, *, write: bool) -> torch.Tensor:
        """Unit ``unit``'s chunk in memory (read in unless cached); ``write``: the caller will
        change it, so it is written back before its buffer is reused. Valid until the next
        ``get`` or ``stage`` of another unit."""
        self._check()
        if write:
            with self._unpinned:  # a gather still copying this chunk in reads it
                self._unpinned.wait_for(lambda: unit not in self._pins)
        buffer = self._cached.get(unit)
        if buffer is None:
            buffer = self._take_buffer()
            if self.file.written(self.offsets[unit]):
                try:
                    self.file.read(self.offsets[unit], buffer, self.nbytes[unit])
                except SwapError as error:
                    self._free.append(buffer)  # holds nothing: the next use may take it
                    self.broken = self.broken or error
                    raise
                self.reads += 1
            self._cached[unit] = buffer
        elif unit in self._reading:
            self._collect(unit)
            self._check()
        self._cached.move_to_end(unit)
        if write:
            self._dirty.add(unit)
        return buffer[: self.nbytes[unit]].view(self.dtype)

    def stage(self, unit: int) -> Callable[[], torch.Tensor]:
        """For a gather that copies unit ``unit``'s chunk in on another thread: the chunk's
        read started on the I/O thread (unless it is in memory) and its buffer pinned. Returns
        ``take``, which waits for the read and gives the chunk; call ``unpin(unit)`` once it
        is copied (whatever happened)."""
        self._check()
        buffer = self._cached.get(unit)
        if buffer is None:
            buffer = self._take_buffer()
            self._cached[unit] = buffer
            if self.file.written(self.offsets[unit]):
                offset, nbytes = self.offsets[unit], self.nbytes[unit]
                self._reading[unit] = self._io.submit(self.file.read, offset, buffer, nbytes)
                self.reads += 1
                self.staged_reads += 1
        self._cached.move_to_end(unit)
        with self._unpinned:
            self._pins[unit] = self._pins.get(unit, 0) + 1
        reading = self._reading.get(unit)
        chunk = buffer[: self.nbytes[unit]].view(self.dtype)

        def take() -> torch.Tensor:
            if reading is not None:
                error = reading.exception()
                if error is not None:
                    # Broken from now on, before anything else stages or waits for a buffer
                    # (this chunk's buffer is tidied when collected).
                    self.broken = self.broken or error
                    raise error
            return chunk

        return take

    def unpin(self, unit: int) -> None:
        with self._unpinned:
            self._pins[unit] -= 1
            if not self._pins[unit]:
                del self._pins[unit]
            self._unpinned.notify_all()

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken

    def _collect(self, unit: int) -> None:
        """Wait for the read ``stage`` started for ``unit``. A failed one breaks the swap and
        takes the unit out of memory (its buffer freed, never written back)."""
        error = self._reading.pop(unit).exception()
        if error is not None:
            self.broken = self.broken or error
            self._dirty.discard(unit)
            self._free.append(self._cached.pop(unit))

    def _take_buffer(self) -> torch.Tensor:
        if self._free:
            return self._free.pop()
        if self._allocated < self._count:
            self._allocated += 1
            return aligned_empty(self._size)
        with self._unpinned:  # the least recently used chunk no gather still copies from
            self._unpinned.wait_for(lambda: any(u not in self._pins for u in self._cached))
            unit = next(u for u in self._cached if u not in self._pins)
        if unit in self._reading:  # staged for a gather that has copied it in since
            self._collect(unit)
            if unit not in self._cached:  # its read failed: the buffer was freed
                return self._free.pop()
        buffer = self._cached.pop(unit)
        try:
            self._write_back(unit, buffer)
        except BaseException:
            self._free.append(buffer)  # the chunk is lost with the swap; not the buffer
            raise
        return buffer

    def _write_back(self, unit: int, buffer: torch.Tensor) -> None:
        if unit in self._dirty:
            self.file.write(self.offsets[unit], buffer, self.nbytes[unit])
            self._dirty.discard(unit)
            self.writes += 1

    def flush(self) -> None:
        """Every changed chunk to disk, and the buffers emptied (the file is the whole truth
        again: a checkpoint or a fresh read sees every update)."""
        with self._unpinned:
            self._unpinned.wait_for(lambda: not self._pins)
        for unit in list(self._reading):
            self._collect(unit)
        self._check()
        while self._cached:
            unit, buffer = self._cached.popitem(last=False)
            self._free.append(buffer)
            self._write_back(unit, buffer)

    def buffer_bytes(self) -> int:
        return self._allocated * aligned(self._size)

    def file_bytes(self) -> int:
        return self.file.nbytes

    def close(self) -> None:
        """Remove the file (its contents are scratch); the chunks are gone."""
        for read in self._reading.values():
            read.exception()  # landed (or failed) before its file goes
        self._reading.clear()
        self._io.shutdown(wait=True)
        self._cached.clear()
        self._free.clear()
        self._allocated = 0
        self.file.close()
