"""The watchdog: which rank a blocked wait is waiting for, said long before the timeout.

gloo tells a rank blocked in a collective nothing about its peers until the process group's
timeout (ten minutes by default) ends the wait. So each rank publishes a heartbeat, out of band,
in the job's rendezvous store (the TCPStore every rank already talks to): every ``interval``
seconds a thread writes a beat count and what the rank is blocked in, if anything. A wait on a
gloo collective (``Handle.wait``) blocks in slices of one interval and reads its group's
heartbeats after each. Point-to-point waits are not sliced: gloo breaks the whole group when a
timed wait on a send or receive times out.

Collectives are numbered per group as they are issued (``issue``), the same on every rank. A
rank blocked in collective #j of a group while a peer waits at a *check-in* (a call every rank
must make, such as ``save_checkpoint``, entered through ``check_in``) having issued fewer than j
collectives there can never be met: the peer will not issue #j before its check-in completes,
and that needs this rank. Both sides see it from each other's heartbeat and raise at once,
naming the call and the ranks; so do two ranks waiting at check-ins of different names. The
numbers make a stale heartbeat harmless: a peer that has since finished op #j must have had this
rank's part of it, so it was never a peer this rank could not meet; and a peer's wait counts
only once two of its heartbeats in a row show it. Once a wait has lasted
``report_after`` seconds, a warning (repeated every ``report_after`` seconds) names each peer
that has not arrived and why it may not have: its heartbeat stopped (a stopped, hung or dead
process), it waits in another op, or it is alive and in no op.

The process group's timeout still ends the wait. The slices cost nothing when an op completes
within one: the wait blocks in C++ as before. NCCL has a watchdog of its own; its waits are not
sliced. Settings come from the environment, read when the process group starts:
``ZEROLAP_WATCHDOG=0`` turns it off, ``ZEROLAP_WATCHDOG_INTERVAL`` (seconds, default 5) and
``ZEROLAP_WATCHDOG_REPORT`` (seconds, default 60). After a ``CheckInError`` or ``CommError``
the group is out of step (a collective may still be in flight): end the job.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch.distributed as torch_dist

from zerolap.utils.logging import logger

__all__ = ["CheckInError", "Watchdog", "check_in", "current", "issue", "start", "stop"]

COLLECTIVE = "collective"
CHECK_IN = "check-in"


class CheckInError(RuntimeError):
    """A call every rank must make was made on some ranks only (the others are elsewhere)."""


class SliceTimeout(Exception):
    """One slice of a watched wait ended before the op did (not an error)."""


# Collectives issued per group (by its ranks), counted whether or not a watchdog runs.
_issued: dict[tuple[int, ...], int] = {}


def issue(ranks: list[int]) -> int:
    """Count one more collective on the group of ``ranks``; its number (from 1)."""
    key = tuple(ranks)
    number = _issued[key] = _issued.get(key, 0) + 1
    return number


@dataclass
class _Blocked:
    kind: str  # COLLECTIVE or CHECK_IN
    op: str  # the collective, or the check-in's name
    ranks: list[int]
    number: int  # the collective's number on the group; at a check-in, how many were issued
    call: int  # a check-in's count among this rank's check-ins of that name (0 for collectives)
    since: float  # time.monotonic() on this rank

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "op": self.op,
            "ranks": self.ranks,
            "number": self.number,
            "call": self.call,
            "for": round(time.monotonic() - self.since, 1),
        }


class Watchdog:
    def __init__(
        self, store, rank: int, *, interval: float, report_after: float, timeout: float
    ) -> None:
        self.store, self.rank = store, rank
        self.timeout = timeout  # the process group's: how long a check-in waits at most
        self.interval, self.report_after = interval, report_after
        # Per thread (tensor parallelism's lanes wait on two), read by the beat thread.
        self._blocked: dict[int, _Blocked] = {}
        self._beats = 0
        self._lock = threading.Lock()  # one heartbeat written at a time, beats in order
        self._moved: dict[int, tuple[int, float]] = {}  # peer: (its beat, when it last moved)
        # peer: the wait its last heartbeat showed, and whether the one before showed it too
        # (a wait seen at two beats is current, not a snapshot the peer has since left)
        self._waits: dict[int, tuple[tuple | None, bool]] = {}
        self._check_ins: dict[tuple, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zerolap-watchdog", daemon=True)

    def start(self) -> None:
        self._publish()
        self._thread.start()

    def stop(self) -> None:
        """End the beat thread, waiting for a heartbeat in flight: a thread still inside the
        store when the process exits takes the process down with it."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(self.interval):
            try:
                self._publish()
                failing = False
            except Exception as err:  # a store hiccup; the peers see the beat pause meanwhile
                if not failing:
                    logger.debug(f"watchdog: heartbeat not published: {err}")
                failing = True

    def _publish(self) -> None:
        """This rank's heartbeat: a beat number and its longest current wait, if any."""
        with self._lock:
            waits = sorted(self._blocked.copy().values(), key=lambda b: b.since)
            self._beats += 1
            state = {"beat": self._beats, "blocked": waits[0].as_dict() if waits else None}
            self.store.set(f"zerolap/heartbeat/{self.rank}", json.dumps(state))

    # -- reading the peers --------------------------------------------------------------------

    def _read(self, ranks: list[int]) -> dict[int, dict | None] | None:
        """The peers' latest heartbeats (None for a peer that never published); None when the
        store cannot be read (it lives with rank 0's launcher, which may be gone)."""
        peers = [r for r in ranks if r != self.rank]
        keys = [f"zerolap/heartbeat/{r}" for r in peers]
        try:
            present = [self.store.check([key]) for key in keys]
            found = [key for key, here in zip(keys, present, strict=True) if here]
            values = iter(self.store.multi_get(found) if found else [])
        except Exception:
            return None
        now = time.monotonic()
        states: dict[int, dict | None] = {}
        for rank, here in zip(peers, present, strict=True):
            if not here:
                states[rank] = None
                continue
            state = states[rank] = json.loads(next(values))
            seen = self._moved.get(rank)
            if seen is None or seen[0] != state["beat"]:
                self._moved[rank] = (state["beat"], now)
                theirs = state["blocked"]
                wait = None if theirs is None else (theirs["kind"], theirs["op"], theirs["number"])
                before = self._waits.get(rank, (None, False))[0]
                self._waits[rank] = (wait, seen is not None and wait is not None and wait == before)
        return states

    def _silent_for(self, rank: int) -> float:
        return time.monotonic() - self._moved[rank][1]

    @contextlib.contextmanager
    def _blocked_in(
        self,
        kind: str,
        op: str,
        ranks: list[int],
        number: int,
        call: int = 0,
        since: float | None = None,
    ) -> Iterator[_Blocked]:
        blocked = _Blocked(kind, op, ranks, number, call, since or time.monotonic())
        thread = threading.get_ident()
        previous = self._blocked.get(thread)
        self._blocked[thread] = blocked
        try:
            yield blocked
        finally:
            if previous is None:
                del self._blocked[thread]
            else:
                self._blocked[thread] = previous

    def _never_met(self, blocked: _Blocked, rank: int, theirs: dict) -> bool:
        """Whether this rank's wait and ``rank``'s can never both complete (see the module):
        judged only on a wait the peer showed at two heartbeats in a row, and never on a
        check-in this rank has made too (the peer may have left it since)."""
        if theirs["ranks"] != blocked.ranks or not self._waits[rank][1]:
            return False
        if theirs["kind"] == CHECK_IN:
            made = self._check_ins.get((theirs["op"], *blocked.ranks), 0)
            if made > theirs["call"]:
                return False
            if blocked.kind == COLLECTIVE:
                return theirs["number"] < blocked.number
            return theirs["op"] != blocked.op
        return blocked.kind == CHECK_IN and theirs["number"] > blocked.number

    def _absence(self, rank: int, state: dict | None, blocked: _Blocked) -> str | None:
        """Why ``rank`` may not have arrived where this rank waits; None when it has."""
        if state is None:
            return f"rank {rank} has published no heartbeat (not started, or its watchdog is off)"
        silent = self._silent_for(rank)
        if silent > 3 * self.interval:
            return (
                f"rank {rank} has sent no heartbeat for {silent:.0f} s: it is stopped (SIGSTOP), "
                "hung outside Python, or dead"
            )
        theirs = state["blocked"]
        if theirs is None:
            return f"rank {rank} is alive and in no collective (computing, or skipping this one)"
        if (theirs["kind"], theirs["op"], theirs["ranks"]) != (
            blocked.kind,
            blocked.op,
            blocked.ranks,
        ):
            return f"rank {rank} waits in {theirs['op']} on ranks {theirs['ranks']}"
        return None

    def _report(self, blocked: _Blocked, states: dict) -> None:
        absent = [
            why
            for rank, state in states.items()
            if (why := self._absence(rank, state, blocked)) is not None
        ]
        waited = time.monotonic() - blocked.since
        where = (
            f"rank {self.rank} has waited {waited:.0f} s in {blocked.op} on ranks {blocked.ranks}"
        )
        logger.warning(
            f"{where}: " + ("; ".join(absent) or "every peer is there too: the op is slow")
        )

    # -- waiting --------------------------------------------------------------------------------

    def _watch(self, blocked: _Blocked, done: Callable[[], bool]) -> None:
        """Call ``done`` (which blocks at most one interval) until it is true; in between,
        read the group's heartbeats: a peer this wait can never meet raises ``CheckInError``
        here, and tells the peer, whose evidence goes as soon as this rank leaves its wait
        (a refusal left in the store for it, read after each of its slices). Every
        ``report_after`` seconds the absent peers are reported."""
        reported = 0.0
        refusal = f"zerolap/refusal/{self.rank}"
        while not done():
            told = None
            with contextlib.suppress(Exception):  # an unreachable store: read next time
                if self.store.check([refusal]):
                    told = self.store.get(refusal).decode()
            if told is not None:
                raise CheckInError(told)
            states = self._read(blocked.ranks)
            if states is None:
                continue
            for rank, state in states.items():
                theirs = state and state["blocked"]
                if theirs and self._never_met(blocked, rank, theirs):
                    mine = (blocked.kind, blocked.op, self.rank)
                    other = (theirs["kind"], theirs["op"], rank)
                    with contextlib.suppress(Exception):
                        self.store.set(
                            f"zerolap/refusal/{rank}", _unmet(other, mine, blocked.ranks)
                        )
                    raise CheckInError(_unmet(mine, other, blocked.ranks))
            if time.monotonic() - blocked.since >= reported + self.report_after:
                reported += self.report_after
                self._report(blocked, states)

    def wait(
        self,
        op: str,
        ranks: list[int],
        number: int,
        wait_slice: Callable[[float], None],
        since: float,
    ) -> None:
        """Block until collective #``number`` of the group, waited on since ``since``
        (``time.monotonic()``), completes, calling ``wait_slice`` with one interval at a time
        (it raises ``SliceTimeout`` when the slice ends first)."""

        def done() -> bool:
            try:
                wait_slice(self.interval)
            except SliceTimeout:
                return False
            return True

        with self._blocked_in(COLLECTIVE, op, ranks, number, since=since) as blocked:
            self._watch(blocked, done)

    def _poll(self, key: str, seconds: float) -> bool:
        """Whether ``key`` appears within ``seconds`` (polled: the store's own timed wait logs
        a warning from C++ every time it times out)."""
        deadline = time.monotonic() + seconds
        pause = 0.001
        while not self.store.check([key]):
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        return True

    def check_in(self, name: str, ranks: list[int]) -> None:
        """Return once every rank of ``ranks`` has called ``check_in(name)`` as often as this one;
        raise ``CheckInError`` as soon as one of them is seen where it can never come (in a
        collective this rank has not issued, or at another check-in), or after the process
        group's timeout."""
        call = self._check_ins.get((name, *ranks), 0)
        self._check_ins[(name, *ranks)] = call + 1
        key = f"zerolap/check_in/{name}/{'-'.join(map(str, ranks))}/{call}"
        if self.store.add(key, 1) == len(ranks):
            self.store.set(f"{key}/all", "1")

        def done() -> bool:
            waited = time.monotonic() - blocked.since
            if waited > self.timeout:
                raise CheckInError(
                    f"{name} must be called on every rank of {ranks}: rank {self.rank} waited "
                    f"{waited:.0f} s for the others"
                )
            return self._poll(f"{key}/all", min(self.interval, self.timeout))

        issued = _issued.get(tuple(ranks), 0)
        with self._blocked_in(CHECK_IN, name, ranks, issued, call) as blocked:
            self._publish()  # seen at once, not an interval later
            self._watch(blocked, done)


def _unmet(waiting: tuple[str, str, int], other: tuple[str, str, int], ranks: list[int]) -> str:
    """What the rank ``waiting`` (kind, op, rank) is told of ``other``, which it can never
    meet: one of them waits at a check-in."""
    kind, op, rank = waiting
    _, other_op, other_rank = other
    if kind == CHECK_IN:
        return (
            f"{op} must be called on every rank of {ranks}: rank {other_rank} waits in "
            f"{other_op} instead of calling it"
        )
    return (
        f"rank {other_rank} is in {other_op}, which every rank of {ranks} must call, while "
        f"rank {rank} waits in {op}: call {other_op} on every rank"
    )


_watchdog: Watchdog | None = None


def current() -> Watchdog | None:
    return _watchdog


def start(rank: int, world_size: int, timeout: float) -> None:
    """Start this process's watchdog (``init_distributed``), unless it is turned off, the job
    is one process, or the process group has no store to publish in. A watchdog left from an
    earlier process group (destroyed through torch directly) is replaced."""
    global _watchdog
    if os.environ.get("ZEROLAP_WATCHDOG", "1") == "0" or world_size == 1:
        return
    try:
        store = torch_dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return
    if _watchdog is not None:
        if _watchdog.store is store and _watchdog.alive():
            return
        stop()
    _issued.clear()  # a new group numbers its collectives from 1 on every rank
    _watchdog = Watchdog(
        store,
        rank,
        interval=float(os.environ.get("ZEROLAP_WATCHDOG_INTERVAL", 5)),
        report_after=float(os.environ.get("ZEROLAP_WATCHDOG_REPORT", 60)),
        timeout=timeout,
    )
    _watchdog.start()
    atexit.register(stop)


def stop() -> None:
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None


def check_in(name: str, ranks: list[int]) -> None:
    """``Watchdog.check_in`` when a watchdog runs; without one, nothing is checked."""
    if _watchdog is not None and len(ranks) > 1:
        _watchdog.check_in(name, ranks)
