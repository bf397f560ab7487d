"""Stages 0-2: parameters moved into one contiguous buffer, each ``param.data`` a view into it.

Every rank holds every parameter; after a sharded optimizer step each bucket is all-gathered
from the owners of its chunks (``publish``), over the group its chunks are spread over (the
data-parallel group; an expert bucket's expert-data-parallel group). With ``defer`` the
gathers are left in flight, to be waited by the first module that uses each bucket
(``zero.in_flight``); ``settle()`` waits for all of them, and every method here that reads or
writes the values calls it first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial

import torch

from zerolap.comm import CommError
from zerolap.zero.gather import all_gather_bucket
from zerolap.zero.in_flight import InFlightParameter
from zerolap.zero.layout import FlatLayout, OwnedRun

__all__ = ["FlatParams"]


class _NeverLaunched:
    """Stands for the handle of a bucket whose all-gather a failed ``publish`` never started."""

    def __init__(self, index: int, error: BaseException) -> None:
        self.index, self.error = index, error

    def wait(self) -> None:
        raise CommError(
            f"bucket {self.index}'s parameters were never all-gathered after the last step: "
            f"{self.error!r}"
        ) from self.error


class FlatParams:
    swap = None  # parameters are never swapped below stage 3
    host = None  # nor kept in host memory apart from an accelerator

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        layout: FlatLayout,
        *,
        groups: list,
        rank: int,
        native: bool,
        sharded: bool,
        defer: bool = False,
    ) -> None:
        first = params[0]
        self.layout = layout
        self.groups = groups  # per bucket, the group its chunks are spread over
        self.rank, self.native = rank, native
        self.sharded = sharded  # whether the optimizer updates only this rank's chunks
        self.params = params  # in layout slot order
        # Leave the gathers in flight after publish() (only plain parameters: the in-flight
        # class replaces theirs for the while, and another subclass's behaviour would be lost).
        self.defer = sharded and defer and all(type(p) is torch.nn.Parameter for p in params)
        self._bucket_params = [[params[slot] for slot in b.slots] for b in layout.buckets]
        self._in_flight: dict[int, object] = {}  # bucket index -> its all-gather's handle
        # Called when the last gather in flight has been waited: with the optimizer's swapped
        # sub-groups stepping in the gathers (``zero.step_behind``), whoever waits for them all
        # (the forward's last bucket, a state dict) learns whether every rank's step ran.
        self.after_settled: Callable[[], None] | None = None
        # A thread reading parameters (a snapshot for logging or an async checkpoint) may wait
        # for a bucket while the training thread's forward waits for the same one.
        self._waiting = threading.RLock()
        # On CUDA, the stream training ran on when the gathers were launched: a wait orders it
        # after them, whichever thread waits first (a reader on its own stream then waits for
        # that stream), so the training stream never misses a gather another thread took.
        self._stream = None
        self.flat = torch.zeros(layout.numel, dtype=first.dtype, device=first.device)
        for slot, param in zip(layout.slots, params, strict=True):
            view = self.flat[slot.offset : slot.offset + slot.numel].view_as(param)
            view.copy_(param.detach())
            param.data = view

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    @property
    def device(self) -> torch.device:
        return self.flat.device

    def owned_view(self, run: OwnedRun, shard_pos: int) -> torch.Tensor:
        """The parameter elements of ``run`` (``shard_pos`` is unused: the buffer is flat)."""
        return self.flat[run.start : run.end]

    def publish(self, prepare: Callable[[int], None] | None = None) -> None:
        """Every bucket all-gathered from its chunks' owners, all in flight at once and in the
        order forward needs them (the reverse of bucket order); waited here unless deferred.
        ``prepare(b)`` runs just before bucket ``b``'s gather, on the thread that runs it (the
        ring's on gloo): there it steps the swapped sub-groups the bucket needs
        (``zero.step_behind``)."""
        if not self.sharded:
            return
        self.settle()
        if self.defer and self.flat.device.type == "cuda":
            self._stream = torch.cuda.current_stream(self.flat.device)
        if self.defer:
            # Marked before the first launch, so no read in between can see a stale chunk.
            for param in self.params:
                param.__class__ = InFlightParameter
                param._zerolap_in_flight = self
        try:
            for b in reversed(self.layout.buckets):
                region = self.flat[b.start : b.end]
                self._in_flight[b.index] = all_gather_bucket(
                    region,
                    b,
                    rank=self.rank,
                    group=self.groups[b.index],
                    native=self.native,
                    prepare=partial(prepare, b.index) if prepare is not None else None,
                )
        except BaseException as error:
            # The buckets never launched hold stale chunks: waiting for them raises this error,
            # so the engine's own readers (and, deferred, every read) fail instead of using them.
            for b in self.layout.buckets:
                self._in_flight.setdefault(b.index, _NeverLaunched(b.index, error))
            raise
        if not self.defer:
            self.settle()

    @property
    def in_flight(self) -> bool:
        """Whether some bucket's gather has not been waited yet."""
        return bool(self._in_flight)

    def wait_buckets(self, indices) -> bool:
        """Wait for the gathers of buckets ``indices`` still in flight; their parameters are
        plain parameters again. Whether there was any to wait for. A wait that raises leaves
        its bucket in flight (its parameters still guarded), so the next read raises too."""
        waited = False
        on = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with self._waiting, on:
            for index in indices:
                handle = self._in_flight.get(index)
                if handle is None:
                    continue
                handle.wait()
                del self._in_flight[index]
                waited = True
                for param in self._bucket_params[index]:
                    if type(param) is InFlightParameter:
                        param.__class__ = torch.nn.Parameter
                        del param._zerolap_in_flight
        if self._stream is not None:  # waited here, or by another thread before
            caller = torch.cuda.current_stream(self.flat.device)
            if caller != self._stream:
                caller.wait_stream(self._stream)
        if waited and not self._in_flight and self.after_settled is not None:
            self.after_settled()
        return waited

    def settle(self) -> None:
        """Wait for every gather still in flight, in the order they were launched."""
        if self._in_flight:
            self.wait_buckets(list(self._in_flight))

    def detach_params(self) -> None:
        """Each parameter takes its own copy of its values and stops viewing the flat buffer
        (``engine.destroy()``), which can then be freed."""
        self.settle()
        for slot, param in zip(self.layout.slots, self.params, strict=True):
            param.data = self.flat[slot.offset : slot.offset + slot.numel].view_as(param).clone()
        self.flat = self.flat.new_empty(0)  # a [:0] view would keep the storage alive

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def pinned(self) -> bool:
        return False  # GatheredParameters has nothing to hold below stage 3

    def device_tensors(self) -> list[torch.Tensor]:
        """The memory the parameters live in (``offload_states``' lp_params)."""
        return [self.flat]

    def buffer_bytes(self) -> int:
        return 0  # nothing beyond the flat buffer itself

    def host_bytes(self) -> int:
        return 0

    def swap_buffer_bytes(self) -> int:
        return 0  # stages 0-2 keep parameters in memory

    def swapped_bytes(self) -> int:
        return 0
