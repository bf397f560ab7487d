"""The watchdog: which rank a blocked wait is waiting for, said long before the timeout.

gloo tells a rank blocked in a collective nothing about its peers until the process group's
timeout (ten minutes by default) ends the wait. So each rank publishes a heartbeat, out of band,
in the job's rendezvous store (the TCPStore every rank already talks to): every ``interval``
seconds a thread writes a beat count and what the rank is blocked in, if anything. A wait
(``Handle.wait``) blocks in slices of one interval and reads its group's heartbeats after each:

* a peer blocked at a *check-in* (a call every rank must make, such as ``save_checkpoint``,
  entered through ``check_in``) while this rank is blocked in a collective, or the other way
  round, can never be met: both raise at once, naming the call and the ranks;
* once a wait has lasted ``report_after`` seconds, a warning (repeated every ``report_after``
  seconds) names each peer that has not arrived and why it may not have: its heartbeat stopped
  (a stopped, hung or dead process), it waits in another op, or it is alive and in no op.

The process group's timeout still ends the wait. The slices cost nothing when an op completes
within one: the wait blocks in C++ as before. NCCL has a watchdog of its own; its waits are not
sliced. Settings come from the environment, read when the process group starts:
``ZEROLAP_WATCHDOG=0`` turns it off, ``ZEROLAP_WATCHDOG_INTERVAL`` (seconds, default 5) and
``ZEROLAP_WATCHDOG_REPORT`` (seconds, default 60).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch.distributed as torch_dist

from zerolap.utils.logging import logger

__all__ = ["CheckInError", "Watchdog", "check_in", "current", "start", "stop"]

COLLECTIVE = "collective"
CHECK_IN = "check-in"


class CheckInError(RuntimeError):
    """A call every rank must make was made on some ranks only (the others are elsewhere)."""


class SliceTimeout(Exception):
    """One slice of a watched wait ended before the op did (not an error)."""


@dataclass
class _Blocked:
    kind: str  # COLLECTIVE or CHECK_IN
    op: str
    ranks: list[int]
    number: int  # this rank's count of watched waits: tells one wait from the next
    since: float  # time.monotonic() on this rank

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "op": self.op,
            "ranks": self.ranks,
            "number": self.number,
            "for": round(time.monotonic() - self.since, 1),
        }


class _Peer:
    """What this rank last read of a peer's heartbeat, and when the beat last moved (measured
    on this rank's clock: hosts' clocks need not agree)."""

    def __init__(self, state: dict, now: float) -> None:
        self.beat, self.moved = state["beat"], now
        self.blocked = state["blocked"]
        self.confirmed = False  # blocked in the same wait at two beats: not a stale snapshot


class Watchdog:
    def __init__(
        self, store, rank: int, *, interval: float, report_after: float, timeout: float
    ) -> None:
        self.store, self.rank = store, rank
        self.timeout = timeout  # the process group's: how long a check-in waits at most
        self.interval, self.report_after = interval, report_after
        # Per thread (tensor parallelism's lanes wait on two), read by the beat thread.
        self._blocked: dict[int, _Blocked] = {}
        self._beats = itertools.count(1)
        self._waits = itertools.count()
        self._peers: dict[int, _Peer] = {}
        self._check_ins: dict[tuple, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zerolap-watchdog", daemon=True)

    def start(self) -> None:
        self._publish()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._publish()
            except Exception:  # the store went away with the process group: nothing to watch
                return

    def _publish(self) -> None:
        """This rank's heartbeat: a beat number and its longest current wait, if any."""
        waits = sorted(self._blocked.copy().values(), key=lambda b: b.since)
        state = {"beat": next(self._beats), "blocked": waits[0].as_dict() if waits else None}
        self.store.set(f"zerolap/heartbeat/{self.rank}", json.dumps(state))

    # -- reading the peers --------------------------------------------------------------------

    def _read(self, ranks: list[int]) -> dict[int, dict | None]:
        """The peers' latest heartbeats (None for a peer that never published)."""
        states = {}
        now = time.monotonic()
        for rank in ranks:
            if rank == self.rank:
                continue
            key = f"zerolap/heartbeat/{rank}"
            if not self.store.check([key]):
                states[rank] = None
                continue
            state = states[rank] = json.loads(self.store.get(key))
            seen = self._peers.get(rank)
            if seen is None or seen.beat != state["beat"]:
                peer = self._peers[rank] = _Peer(state, now)
                peer.confirmed = (
                    seen is not None
                    and peer.blocked is not None
                    and seen.blocked is not None
                    and peer.blocked["number"] == seen.blocked["number"]
                )
        return states

    def _silent_for(self, rank: int) -> float:
        return time.monotonic() - self._peers[rank].moved

    @contextlib.contextmanager
    def _blocked_in(self, kind: str, op: str, ranks: list[int]) -> Iterator[_Blocked]:
        blocked = _Blocked(kind, op, ranks, next(self._waits), time.monotonic())
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

    def _other_kind(self, blocked: _Blocked, states: dict) -> tuple[int, dict] | None:
        """A peer of the group blocked in the other kind of wait (a check-in against a
        collective), seen so at two of its beats: the two can never meet."""
        for rank, state in states.items():
            theirs = state and state["blocked"]
            if (
                theirs
                and theirs["kind"] != blocked.kind
                and theirs["ranks"] == blocked.ranks
                and self._peers[rank].confirmed
            ):
                return rank, theirs
        return None

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
        if theirs["op"] != blocked.op or theirs["kind"] != blocked.kind:
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

    def _watch(
        self, blocked: _Blocked, done: Callable[[], bool], refuse: Callable[[int, dict], str]
    ) -> None:
        """Call ``done`` (which blocks at most one interval) until it is true; in between,
        read the group's heartbeats: a peer blocked in the other kind of wait raises
        ``CheckInError(refuse(its rank, its wait))``, and every ``report_after`` seconds the
        absent peers are reported."""
        reported = 0.0
        while not done():
            states = self._read(blocked.ranks)
            if (other := self._other_kind(blocked, states)) is not None:
                raise CheckInError(refuse(*other))
            if time.monotonic() - blocked.since >= reported + self.report_after:
                reported += self.report_after
                self._report(blocked, states)

    def wait(self, op: str, ranks: list[int], wait_slice: Callable[[float], None]) -> None:
        """Block until ``wait_slice`` returns, calling it with one interval at a time (it raises
        ``SliceTimeout`` when the slice ends first)."""

        def done() -> bool:
            try:
                wait_slice(self.interval)
            except SliceTimeout:
                return False
            return True

        def refuse(rank: int, theirs: dict) -> str:
            return (
                f"rank {rank} is in {theirs['op']}, which every rank of {ranks} must call, "
                f"while rank {self.rank} waits in {op}: call {theirs['op']} on every rank"
            )

        with self._blocked_in(COLLECTIVE, op, ranks) as blocked:
            self._watch(blocked, done, refuse)

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
        raise ``CheckInError`` as soon as one of them is seen blocked in a collective instead,
        or after the process group's timeout."""
        count = self._check_ins.get((name, *ranks), 0)
        self._check_ins[(name, *ranks)] = count + 1
        key = f"zerolap/check_in/{name}/{'-'.join(map(str, ranks))}/{count}"
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

        def refuse(rank: int, theirs: dict) -> str:
            return (
                f"{name} must be called on every rank of {ranks}: rank {rank} waits in "
                f"{theirs['op']} instead of calling it"
            )

        with self._blocked_in(CHECK_IN, name, ranks) as blocked:
            self._publish()  # seen at once, not an interval later
            self._watch(blocked, done, refuse)


_watchdog: Watchdog | None = None


def current() -> Watchdog | None:
    return _watchdog


def start(rank: int, world_size: int, timeout: float) -> None:
    """Start this process's watchdog (``init_distributed``), unless it is turned off, the job
    is one process, or the process group has no store to publish in."""
    global _watchdog
    if os.environ.get("ZEROLAP_WATCHDOG", "1") == "0" or world_size == 1 or _watchdog is not None:
        return
    try:
        store = torch_dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return
    _watchdog = Watchdog(
        store,
        rank,
        interval=float(os.environ.get("ZEROLAP_WATCHDOG_INTERVAL", 5)),
        report_after=float(os.environ.get("ZEROLAP_WATCHDOG_REPORT", 60)),
        timeout=timeout,
    )
    _watchdog.start()


def stop() -> None:
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None


def check_in(name: str, ranks: list[int]) -> None:
    """``Watchdog.check_in`` when a watchdog runs; without one, nothing is checked."""
    if _watchdog is not None and len(ranks) > 1:
        _watchdog.check_in(name, ranks)
