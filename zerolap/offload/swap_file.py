"""Swap files: the disk tier of offload (``device: "nvme"``), with plain POSIX I/O.

A ``SwapFile`` is one preallocated file under ``nvme_path`` holding tensors between uses, read
and written a whole region at a time (``pread``/``pwrite`` straight into tensor memory, from
whatever thread calls them: the GIL is released for the I/O).

* **Space is taken at construction** (``posix_fallocate``): a disk too small, a missing or
  unwritable directory fails there, naming it, before any training step.
* **No page cache build-up.** Files are opened with ``O_DIRECT`` where the filesystem takes it
  (buffers and regions are 4 KiB aligned for it). Elsewhere I/O is buffered, and each region's
  pages are written out and dropped once the write or read completes, so the cache holds at most
  the regions in flight.
* **Nothing is taken on trust.** Every region written keeps its checksum in memory (64-bit
  XXH3: 7 to 11 times zlib's CRC-32 on one core here, ``benchmarks/offload_bench.py``; the
  checksums run beside training's compute); a read checks the length read and the checksum, so a
  file cut short or changed underneath is a ``SwapError`` naming the file and the region.

Swap files are scratch: they are removed by ``close()`` (the engine's ``destroy()``, or at
exit); checkpoints hold the state they carried.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import itertools
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import xxhash

__all__ = [
    "ALIGN",
    "SwapError",
    "SwapFile",
    "aligned",
    "aligned_empty",
    "give_back_free_heap",
    "set_up_on_every_rank",
    "swap_path",
]

ALIGN = 4096
"""Alignment of file offsets, lengths and buffer addresses (``O_DIRECT`` needs the device's
logical block size; 4 KiB covers every common one)."""

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_SYNC_RANGE = getattr(_LIBC, "sync_file_range", None)
if _SYNC_RANGE is not None:
    _SYNC_RANGE.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
# SYNC_FILE_RANGE_WAIT_BEFORE | WRITE | WAIT_AFTER: the range is on disk when it returns.
_SYNC_ALL = 1 | 2 | 4
_MALLOC_TRIM = getattr(_LIBC, "malloc_trim", None)  # glibc's; other C libraries have none


def give_back_free_heap() -> None:
    """Return the C heap's free pages to the system. glibc raises its mmap threshold each time
    a large block is freed, so a step's temporaries end up on the heap, and their pages stay
    resident after they are freed: memory that offloading the state was meant to save."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


_instances = itertools.count()
T = TypeVar("T")


def swap_path(directory: Path, rank: int, kind: str) -> Path:
    """A file name under ``directory`` no other swap file takes: this process, a counter, the
    rank and what it holds (``optimizer``, ``params``)."""
    return Path(directory) / f"zerolap-{os.getpid()}-{next(_instances)}-rank{rank}-{kind}.swap"


class SwapError(RuntimeError):
    """A swap file could not hold or give back what it was asked to; names the file."""


def set_up_on_every_rank(build: Callable[[], T], agree: Callable[[float], float], rank: int) -> T:
    """``build()`` (which creates this rank's swap files), then the ranks agree on whether it
    worked everywhere: ``agree(x)`` is the maximum of ``x`` over the ranks. A disk full on one
    rank (its own ``nvme_path``), or any other error there, then stops every rank at once, with
    an error naming that rank, instead of the others going on into collectives the failed rank
    never joins."""
    failure = None
    try:
        built = build()
    except Exception as err:  # a full disk, a bad buffer_count, memory: whatever stops one rank
        failure, built = err, None
    failed = agree(rank + 1.0 if failure is not None else 0.0)
    if failure is not None:
        raise failure
    if failed:
        raise SwapError(
            f"rank {int(failed) - 1} could not set up its swap file (its own error says why), "
            "so no rank trains"
        )
    return built


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of ``aligned(nbytes)`` bytes whose address is a
    multiple of ``ALIGN`` (a slice of a slightly larger allocation), page-locked when ``pin``
    (an accelerator copies it faster)."""
    size = aligned(nbytes)
    raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + size]


def _memory(tensor: torch.Tensor, nbytes: int):
    """A writable buffer over the first ``nbytes`` of ``tensor``'s memory, no copy."""
    return (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())


class SwapFile:
    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = Path(path)
        self.nbytes = aligned(nbytes)
        self._sums: dict[int, int] = {}  # region offset -> checksum of the bytes written there
        # Transfer totals since construction, from every thread (benchmarks read them).
        self.read_bytes = self.write_bytes = 0
        self.read_s = self.write_s = 0.0
        self._count = threading.Lock()
        self.direct = True
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        except OSError as err:
            if err.errno != errno.EINVAL:  # not "this filesystem has no O_DIRECT"
                raise SwapError(f"cannot create swap file {self.path}: {err.strerror}") from None
            self.direct = False
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if self.nbytes:  # an optimizer with no per-element state (SGD) swaps nothing
                os.posix_fallocate(self._fd, 0, self.nbytes)
        except OSError as err:
            free = shutil.disk_usage(self.path.parent).free
            self.close()
            raise SwapError(
                f"cannot allocate swap file {self.path}: {err.strerror} (needs {self.nbytes} "
                f"bytes, {free} free on {self.path.parent})"
            ) from None
        # Scratch: removed when closed, collected, or at interpreter exit, whichever is first.
        self._finalizer = weakref.finalize(self, _remove, self._fd, str(self.path))

    # -- I/O ----------------------------------------------------------------------------------

    def write(self, offset: int, buffer: torch.Tensor, nbytes: int) -> None:
        """The first ``nbytes`` of ``buffer`` (an ``aligned_empty`` tensor) to ``[offset,
        offset + nbytes)``; ``offset`` is a multiple of ``ALIGN``."""
        length = aligned(nbytes) if self.direct else nbytes
        view = _memory(buffer, length)
        checksum = xxhash.xxh3_64_intdigest(memoryview(view)[:nbytes])
        began = time.perf_counter()
        self._transfer(os.pwritev, view, offset, "write")
        if not self.direct:
            self._drop(offset, length, written=True)
        with self._count:
            self.write_bytes += length
            self.write_s += time.perf_counter() - began
        self._sums[offset] = checksum

    def read(self, offset: int, buffer: torch.Tensor, nbytes: int) -> None:
        """``[offset, offset + nbytes)``, as last written, into ``buffer``; a region never
        written, cut short, or whose checksum no longer matches is a ``SwapError``."""
        if offset not in self._sums:
            raise SwapError(f"swap file {self.path}: region at byte {offset} was never written")
        length = aligned(nbytes) if self.direct else nbytes
        view = _memory(buffer, length)
        began = time.perf_counter()
        self._transfer(os.preadv, view, offset, "read")
        if not self.direct:
            self._drop(offset, length, written=False)
        with self._count:
            self.read_bytes += length
            self.read_s += time.perf_counter() - began
        if xxhash.xxh3_64_intdigest(memoryview(view)[:nbytes]) != self._sums[offset]:
            raise SwapError(
                f"swap file {self.path}: the {nbytes} bytes at {offset} are not what was "
                "written there (checksum mismatch): the file was changed underneath"
            )

    def written(self, offset: int) -> bool:
        return offset in self._sums

    def _transfer(self, call, view, offset: int, what: str) -> None:
        done, total = 0, len(view)
        memory = memoryview(view).cast("B")
        while done < total:
            try:
                count = call(self._fd, [memory[done:]], offset + done)
            except OSError as err:
                raise SwapError(
                    f"swap file {self.path}: {what} of {total} bytes at {offset} failed: "
                    f"{err.strerror}"
                ) from None
            if count == 0:
                size = os.fstat(self._fd).st_size
                raise SwapError(
                    f"swap file {self.path}: {what} of {total} bytes at {offset} stopped at "
                    f"{done}: the file is {size} bytes, cut short (expected {self.nbytes})"
                )
            done += count

    def _drop(self, offset: int, length: int, *, written: bool) -> None:
        """Buffered I/O: the range out of the page cache (after writing it to disk)."""
        # Written pages must reach the disk before they can be dropped: the range, or the file.
        if written and not (_SYNC_RANGE and _SYNC_RANGE(self._fd, offset, length, _SYNC_ALL) == 0):
            os.fdatasync(self._fd)
        os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)

    def check_size(self) -> None:
        """The file is still whole: a ``SwapError`` if it was cut short or removed."""
        try:
            size = os.stat(self.path).st_size
        except OSError as err:
            raise SwapError(f"swap file {self.path}: {err.strerror}") from None
        if size < self.nbytes:
            raise SwapError(
                f"swap file {self.path} is {size} bytes, cut short (expected {self.nbytes})"
            )

    def close(self) -> None:
        """Remove the file (its contents are scratch)."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            _remove(self._fd, str(self.path))


def _remove(fd: int, path: str) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
