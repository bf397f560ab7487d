"""The optimizer's step on the host, apart from the accelerator that trains (``offload_optimizer:
{device: cpu}``, and the host side of ``device: nvme``), as ZeRO-Offload does it.

The offloaded runs' fp32 master values and optimizer state live in host memory and the inner
optimizer steps them there (torch's CPU kernels: fused AdamW where the client asked for it).
The accelerator keeps the parameters and gradients it trains with; per step,

* gradients go down as their buckets' reductions are delivered, on a side stream, so the
  copies run under the rest of the backward and the step waits for them once. Stages 2-3 keep
  the offloaded elements of the gradient shard in host memory outright
  (``zero.grad_storage.ShardGradients.place_on_host``: the device holds none of their
  gradients past the reduction); stage 1, whose full gradients stay on the device, has
  ``HostGradients`` copy each bucket's offloaded runs into a (pinned) host buffer in the
  backward that ends the accumulation cycle. The norm and the finite check read each part where
  it is.
* parameters go up: each run's updated master values are copied into the accelerator's
  parameter elements as soon as its sub-group has stepped (``non_blocking`` from pinned memory,
  on the current stream), so the copies run while the host steps the next sub-group, and the
  parameter all-gather after them is ordered behind them by the stream.

On a CPU-only host there is no "apart": the state already is in host memory, and the engine
logs that ``device: cpu`` moves nothing (``zerolap.offload.plan_offload``).
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from zerolap.zero.sub_groups import SubGroup, last_share

__all__ = ["HostAdditions", "HostGradients", "HostPlan"]

# Accumulation's additions on the host stage at most this many elements at a time (64 MiB in
# fp32), through this many buffers: the pinned memory they take does not grow with the bucket
# size (DeepSpeed's default reduce_bucket_size is 5e8 elements).
STAGING_NUMEL = 1 << 24
STAGING_BUFFERS = 2


@dataclass(frozen=True)
class HostPlan:
    """Host memory apart from ``device``: where the optimizer's offloaded runs step
    (``offload_optimizer``), or where stage 3's parameter shard lives (``offload_param``)."""

    device: torch.device  # the accelerator that trains
    ratio: float  # offload_optimizer.ratio: the share of sub-groups moved (1 for parameters)
    pin: bool  # the block's pin_memory, on a CUDA device

    @property
    def host(self) -> torch.device:
        return torch.device("cpu")

    def choose(self, sub_groups: list[SubGroup]) -> list[SubGroup]:
        return last_share(sub_groups, self.ratio)

    def gradients(
        self, runs: list[tuple[int, int]], source: Callable[[int], torch.Tensor], dtype
    ) -> HostGradients:
        return HostGradients(self, runs, source, dtype)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Zeroed host memory, pinned when asked for."""
        return torch.zeros(numel, dtype=dtype, pin_memory=self.pin)

    def additions(self, stream, dtype: torch.dtype, largest: int) -> HostAdditions:
        """Additions of accelerator pieces of ``dtype`` (``largest`` elements at most) into
        host memory, their copies on ``stream`` (None: the pieces are host tensors)."""
        return HostAdditions(stream, dtype, min(largest, STAGING_NUMEL), self.device)


def _add_arrived(target: torch.Tensor, staged: torch.Tensor, copied, free, buffer) -> None:
    try:
        if copied is not None:
            copied.synchronize()
        target.add_(staged)
    finally:
        free.put(buffer)


class HostAdditions:
    """``target += piece``, a host target and a piece on the accelerator, off the calling
    thread: the piece is copied down on ``stream`` (after the work that made it) into a staging
    buffer, and one thread adds it once the copy has arrived, in the order the additions were
    asked for (so the sums are those of adding in place). The caller waits only when both
    staging buffers (``numel`` elements each; longer pieces go in parts) are still taken;
    ``wait()`` before the targets are read.

    Without a stream the pieces are host memory already (the CPU standing in for an
    accelerator in tests) and are staged by a plain copy."""

    def __init__(self, stream, dtype: torch.dtype, numel: int, device: torch.device) -> None:
        self._stream = stream
        self._dtype = dtype  # the pieces'
        self._numel = numel
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._made = 0
        # The thread waits on the device's events: it works on the device, as torch's own
        # pin-memory thread does.
        initializer, initargs = None, ()
        if stream is not None and device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            initializer, initargs = torch.cuda.set_device, (index,)
        self._thread = ThreadPoolExecutor(
            1, thread_name_prefix="zerolap-host-add", initializer=initializer, initargs=initargs
        )
        self._pending: deque[Future] = deque()

    def _buffer(self) -> torch.Tensor:
        """A free staging buffer: made while fewer than ``STAGING_BUFFERS`` exist, else the
        next one the adding thread gives back."""
        if self._made < STAGING_BUFFERS:
            self._made += 1
            # Pinned whatever the block's pin_memory says: a copy into pageable memory would
            # hold the calling thread until the device got there.
            pin = self._stream is not None
            return torch.empty(self._numel, dtype=self._dtype, pin_memory=pin)
        return self._free.get()

    def add(self, target: torch.Tensor, piece: torch.Tensor) -> None:
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(piece.device))
        for lo in range(0, piece.numel(), self._numel):
            part = piece[lo : lo + self._numel]
            buffer = self._buffer()
            try:
                staged = buffer[: part.numel()]
                copied = None
                if self._stream is None:
                    staged.copy_(part)
                else:
                    with torch.cuda.stream(self._stream):
                        staged.copy_(part, non_blocking=True)
                    # A blocking event: the adding thread sleeps on it rather than spinning.
                    copied = torch.cuda.Event(blocking=True)
                    copied.record(self._stream)
                where = target[lo : lo + part.numel()]
                added = self._thread.submit(_add_arrived, where, staged, copied, self._free, buffer)
            except BaseException:
                self._free.put(buffer)  # not handed to the thread: free again
                raise
            self._pending.append(added)

    def wait(self) -> None:
        """Every addition asked for made; the first error among them raised once all ran."""
        error = None
        while self._pending:
            try:
                self._pending.popleft().result()
            except Exception as failure:  # the others still run to their end
                error = error or failure
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop the thread, without waiting: nothing reads the targets any more (the engine
        is done), and a copy whose reduction never completes (a rank died) must not hold up
        the engine's release, which may run in a finalizer."""
        self._pending.clear()
        self._thread.shutdown(wait=False, cancel_futures=True)


class HostGradients:
    """Stage 1: the offloaded runs' gradients, copied off the device bucket by bucket.

    ``runs``: (run index, its bucket) for every offloaded run; ``source(i)``: run ``i``'s
    gradient elements on the device (the gradient store's view; valid until the next cycle
    begins, after the step). A bucket's copy is *final* once made in the backward that ends the
    cycle (``arm``); a bucket delivered outside it (an earlier micro-batch's reduction) is
    copied again at the step."""

    def __init__(
        self,
        plan: HostPlan,
        runs: list[tuple[int, int]],
        source: Callable[[int], torch.Tensor],
        dtype: torch.dtype,
    ) -> None:
        self.source = source
        self.by_bucket: dict[int, list[int]] = {}
        self.offsets: dict[int, tuple[int, int]] = {}  # run -> its [start, end) in the buffer
        at = 0
        for i, bucket in runs:
            numel = source(i).numel()
            self.by_bucket.setdefault(bucket, []).append(i)
            self.offsets[i] = (at, at + numel)
            at += numel
        self.buffer = plan.empty(at, dtype)
        cuda = plan.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=plan.device) if cuda else None
        self._device = plan.device
        self._armed = False
        self._copied: set[int] = set()  # buckets whose final gradients are on the host
        # Bucket copies made as their reductions were delivered, and those left for the step
        # (not overlapped), since construction.
        self.copies_in_backward = 0
        self.copies_at_step = 0

    def view(self, i: int) -> torch.Tensor:
        start, end = self.offsets[i]
        return self.buffer[start:end]

    def arm(self) -> None:
        """The backward that ends the accumulation cycle begins: its deliveries are final
        (anything copied before it is copied again)."""
        self._armed = True
        self._copied.clear()

    def delivered(self, bucket: int) -> None:
        """The reducer delivered ``bucket``'s reduction into the gradient store."""
        if bucket not in self.by_bucket:
            return
        if self._armed:
            self._copy(bucket)
            self.copies_in_backward += 1
        else:
            self._copied.discard(bucket)

    def _copy(self, bucket: int) -> None:
        runs = self.by_bucket[bucket]
        if self._stream is None:
            for i in runs:
                self.view(i).copy_(self.source(i))
        else:
            # After everything the current stream did to the gradients; the step waits for it.
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self._stream):
                for i in runs:
                    self.view(i).copy_(self.source(i), non_blocking=True)
        self._copied.add(bucket)

    def reset(self) -> None:
        """The cycle's gradients are not stepped (a skipped step): nothing is in flight or
        armed after this."""
        if self._stream is not None:
            self._stream.synchronize()
        self._armed = False
        self._copied.clear()

    def take(self) -> dict[int, torch.Tensor]:
        """Every offloaded run's final gradient on the host (those not copied yet are copied
        now), as fp32; the next cycle starts from nothing copied."""
        for bucket in self.by_bucket:
            if bucket not in self._copied:
                self._copy(bucket)
                self.copies_at_step += 1
        self.reset()
        return {i: self.view(i).float() for i in self.offsets}

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
