"""How the full overlap takes turns: two *lanes*, one per half of a micro-batch, each on its
own thread, exactly one of them running at any moment (in a block's forward and in its
backward).

A lane runs until it has launched a tensor-parallel collective, then calls ``switch()``: the
other lane computes while the collective is on the wire, and hands the turn back when it
launches its own. The collectives are therefore issued in one fixed order (lane 0's first, then
lane 1's, alternating), the same on every rank of the tensor group, which is what keeps the
ranks' collectives matched; and only one lane computes at a time, so the two halves never
compete with each other for a core (the collective's own thread still does, on a host without
spare cores). A lane that finishes gives the turn away for good; a lane that fails poisons the
turn, so that the other stops at its next switch instead of issuing collectives no peer will
match. Outside lanes, ``switch()`` does nothing, so the same layer code runs either way.

Grad mode, autocast and the CUDA device and stream follow the caller into the lanes; saved-tensor
hooks do not (``overlap`` refuses to split under them).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import TypeVar

import torch

__all__ = ["in_lanes", "run_two", "switch"]

T = TypeVar("T")

_local = threading.local()
# Two threads serve every call, one call at a time: a call made from inside a lane would need a
# third (the callers run it unsplit instead, see ``in_lanes``), and two callers at once (two
# models trained from two threads) take turns at the lock.
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zerolap-tp-lane")
_ONE_CALL = threading.Lock()


class _Stopped(RuntimeError):
    """The other lane failed; this one stopped at its next switch."""


class _Baton:
    """Whose turn it is. The holder passes it at a switch point or when it finishes."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn = 0
        self._finished = [False, False]
        self._failed: int | None = None

    def take(self, lane: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == lane)

    def switch(self, lane: int) -> None:
        with self._cond:
            self._check(lane)
            if self._finished[1 - lane]:
                return
            self._turn = 1 - lane
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == lane)
            self._check(lane)

    def _check(self, lane: int) -> None:
        if self._failed is not None and self._failed != lane:
            raise _Stopped(f"tensor parallelism: lane {self._failed} failed; lane {lane} stops")

    def finish(self, lane: int, failed: bool) -> None:
        with self._cond:
            self._finished[lane] = True
            if failed and self._failed is None:
                self._failed = lane
            self._turn = 1 - lane
            self._cond.notify_all()


def in_lanes() -> bool:
    """Whether the calling thread is a lane."""
    return getattr(_local, "lane", None) is not None


def switch() -> None:
    """Let the other lane run until it switches back (a lane calls this right after launching
    a collective, before waiting for it); does nothing outside lanes or once the other lane has
    finished."""
    lane = getattr(_local, "lane", None)
    if lane is not None:
        baton, index = lane
        baton.switch(index)


def _caller_modes() -> Callable[[], contextlib.ExitStack]:
    """The caller's thread-local modes, as a context to re-enter on a lane's thread."""
    grad = torch.is_grad_enabled()
    autocast = [
        (device, torch.get_autocast_dtype(device))
        for device in ("cpu", "cuda")
        if torch.is_autocast_enabled(device)
    ]
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = (torch.cuda.current_device(), torch.cuda.current_stream())

    def enter() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(grad))
        for device, dtype in autocast:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        if cuda is not None:
            torch.cuda.set_device(cuda[0])
            stack.enter_context(torch.cuda.stream(cuda[1]))
        return stack

    return enter


def run_two(work: Callable[[int], T]) -> tuple[T, T]:
    """``work(0)`` and ``work(1)`` on two lanes taking turns, lane 0 first; returns both
    results, or raises the first lane's error once both lanes have stopped."""
    if in_lanes():
        raise RuntimeError("tensor parallelism: lanes cannot be nested")
    baton = _Baton()
    modes = _caller_modes()

    def lane(index: int) -> T:
        _local.lane = (baton, index)
        failed = True
        try:
            baton.take(index)
            with modes():
                result = work(index)
            failed = False
            return result
        finally:
            _local.lane = None
            baton.finish(index, failed)

    with _ONE_CALL:
        futures = [_POOL.submit(lane, index) for index in (0, 1)]
        wait_all(futures)
    for future in futures:  # the lane that failed first, not the one it stopped
        error = future.exception()
        if error is not None and not isinstance(error, _Stopped):
            raise error
    return futures[0].result(), futures[1].result()
