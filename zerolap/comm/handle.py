"""The object an ``async_op=True`` call returns.

A ``Handle`` wraps the backend's work (a torch ``Work``, or the future of a ring running on its
worker thread). ``wait()`` blocks until the op is done, runs its completion step once (gloo's
average divides here) and is a no-op after that; ``is_completed()`` polls without blocking.
A failure surfaces as ``CommError`` naming the rank that waited, the op and the group. The
logged record keeps when the caller blocked in ``wait()``: how much of the op was exposed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as torch_dist

from zerolap.comm.logger import COMMS_LOGGER, CommRecord
from zerolap.comm.watchdog import SliceTimeout, issue
from zerolap.comm.watchdog import current as current_watchdog

if TYPE_CHECKING:
    from zerolap.comm.checks import GroupInfo

__all__ = ["CommError", "Handle"]


class CommError(RuntimeError):
    """A collective failed or timed out; the message names the waiting rank, op and group."""


class Handle:
    __slots__ = ("_done", "_finalize", "_info", "_number", "_op", "_record", "_work", "value")

    def __init__(
        self,
        work: torch_dist.Work | Future,
        op: str,
        info: GroupInfo,
        *,
        value: Any = None,
        finalize: Callable[[], None] | None = None,
        record: CommRecord | None = None,
        pairwise: bool = False,
    ) -> None:
        self._work = work
        self._op, self._info = op, info
        # The collective's number on its group (the watchdog tells ops apart by it); None for
        # a send or receive, which pairs two ranks and is waited on whole: gloo answers a
        # timed wait on one by breaking the group.
        self._number = None if pairwise else issue(info.ranks)
        self._finalize = finalize
        self._record = record
        self._done = False
        self.value = value  # the op's output (a tensor or list), valid after wait()
        if record is not None:
            _close_on_completion(work, record)

    def describe(self) -> str:
        """ "rank 0 waited for all_reduce on group ranks [0, 1] (gloo) and it": for errors."""
        return self._info.describe(self._op)

    def is_completed(self) -> bool:
        if isinstance(self._work, Future):
            return self._work.done()
        return self._work.is_completed()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done:
            return True
        began = time.perf_counter() if self._record is not None else 0.0
        watchdog = current_watchdog()
        try:
            if (
                timeout is None
                and watchdog is not None
                and self._number is not None
                and self._info.backend == "gloo"  # NCCL has its own watchdog
            ):
                self._watched_wait(watchdog)
            elif isinstance(self._work, Future):
                self._work.result(None if timeout is None else timeout.total_seconds())
            elif timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
        except Exception as err:
            raise CommError(f"{self.describe()} failed: {err}") from err
        if isinstance(self._work, Future) and self.value is None:
            self.value = self._work.result()
        self._done = True
        if self._finalize is not None:
            self._finalize()
        if self._record is not None:
            self._record.waited = (began, time.perf_counter())
            # Usually closed already by the completion callback; finish() is idempotent.
            COMMS_LOGGER.finish(self._record)
        return True

    def _watched_wait(self, watchdog) -> None:
        """The first slice plainly (most ops end within it: nothing more to pay), the rest
        under the watchdog's eye."""
        since = time.monotonic()
        try:
            self._wait_slice(watchdog.interval)
        except SliceTimeout:
            watchdog.wait(self._op, self._info.ranks, self._number, self._wait_slice, since)

    def _wait_slice(self, seconds: float) -> None:
        """Wait at most ``seconds``; ``SliceTimeout`` if the op is still running then (a gloo
        collective's timed wait leaves it running, to be waited on again)."""
        if isinstance(self._work, Future):
            try:
                self._work.result(seconds)
            except FutureTimeout:
                if self._work.done():  # the op itself raised TimeoutError
                    raise
                raise SliceTimeout from None
            return
        try:
            self._work.wait(timedelta(seconds=seconds))
        except RuntimeError as err:
            if "Operation timed out!" in str(err):
                raise SliceTimeout from None
            raise

    def get_future(self):
        return self._work if isinstance(self._work, Future) else self._work.get_future()


def _close_on_completion(work: torch_dist.Work | Future, record: CommRecord) -> None:
    """Close ``record`` from the backend's thread when a CPU op completes. CUDA ops, and works
    without a future (gloo's point-to-point), are closed in ``wait()`` instead."""
    if record.cuda_events is not None:
        return
    if isinstance(work, Future):
        work.add_done_callback(lambda _: COMMS_LOGGER.finish(record))
        return
    try:
        future = work.get_future()
    except RuntimeError:
        return
    future.add_done_callback(lambda _: COMMS_LOGGER.finish(record))
