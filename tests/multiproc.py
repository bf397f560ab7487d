"""Run test functions on N real processes joined by gloo on localhost.

Two ways to use it:

* ``RankPool(n)``: n worker processes that join one process group once and then run function
  after function (``pool.run(fn, *args)``), so a suite of checks pays the spawn and rendezvous
  cost once per world size. ``fn`` runs on every rank with ``zerolap.comm`` initialised and gets
  the rank's result back; a failure on any rank raises ``RankFailure`` with that rank's traceback.
  A failed or timed-out pool is torn down (its other ranks may be stuck in a collective) and the
  next ``run`` starts a fresh one.
* ``run_on_ranks(fn, n, ...)``: fresh processes for one function, for tests that control the
  environment the ranks start in or that kill a rank.

Functions must be importable (defined at module level) because workers are spawned, not forked.
Every wait has a hard deadline: a deadlock fails the test, it never hangs it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

_CTX = mp.get_context("spawn")
DEFAULT_TIMEOUT = 120.0
# Process-group timeout inside workers: shorter than the test deadline so that a rank stuck in a
# collective whose peer died raises (and reports) before the test gives up on it.
PG_TIMEOUT_S = 45.0


class RankFailure(AssertionError):
    """One or more ranks raised, exited or did not answer in time. ``answers`` maps every rank
    that answered to ``(ok, result or traceback)``."""

    def __init__(self, message: str, answers: dict[int, tuple[bool, Any]]) -> None:
        super().__init__(message)
        self.answers = answers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _setup_worker(env: dict[str, str]) -> None:
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)


def _init_group(rank: int, world_size: int, port: int) -> None:
    import zerolap.comm as dist

    dist.init_distributed(
        dist_backend="gloo",
        rank=rank,
        world_size=world_size,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=PG_TIMEOUT_S,
        verbose=False,
    )


def _call(rank: int, fn: Callable, args: tuple, kwargs: dict) -> tuple[int, bool, bytes]:
    """Run ``fn``; its result travels as plain pickle bytes, because multiprocessing would share
    tensors through memory that disappears when a short-lived worker exits."""
    try:
        return rank, True, pickle.dumps(fn(*args, **kwargs))
    except BaseException:
        return rank, False, pickle.dumps(traceback.format_exc())


def _pool_worker(rank, world_size, port, tasks, results) -> None:
    _setup_worker({})
    _init_group(rank, world_size, port)
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, args, kwargs = task
        results.put(_call(rank, fn, args, kwargs))


def _collect(results, world_size: int, deadline: float, procs) -> dict[int, tuple[bool, Any]]:
    """Gather one answer per rank; after the first failure wait only briefly for the others."""
    answers: dict[int, tuple[bool, Any]] = {}
    seen_dead: set[int] = set()
    while len(answers) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, ok, value = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            # A rank found dead on two polls in a row has no answer still in the pipe.
            dead = {r for r, p in enumerate(procs) if r not in answers and not p.is_alive()}
            for r in dead & seen_dead:
                answers[r] = (False, f"rank {r} exited with code {procs[r].exitcode}")
                deadline = min(deadline, time.monotonic() + 5.0)
            seen_dead = dead
            continue
        answers[rank] = (ok, pickle.loads(value))
        if not ok:
            deadline = min(deadline, time.monotonic() + 5.0)
    return answers


def _raise_failures(fn: Callable, answers: dict, world_size: int, timeout: float) -> list:
    failed = {r: v for r, (ok, v) in answers.items() if not ok}
    silent = [r for r in range(world_size) if r not in answers]
    if not failed and not silent:
        return [answers[r][1] for r in range(world_size)]
    lines = [f"{fn.__qualname__} failed on {world_size} ranks"]
    for rank, text in sorted(failed.items()):
        lines.append(f"--- rank {rank} ---\n{text}")
    if silent:
        lines.append(f"ranks {silent} gave no answer within {timeout:.0f}s (deadlock or hang)")
    raise RankFailure("\n".join(lines), answers)


class RankPool:
    """``world_size`` processes in one gloo group, running test functions on demand."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list = []
        self._tasks: list = []
        self._results = None

    def _start(self) -> None:
        port = free_port()
        self._results = _CTX.Queue()
        self._tasks = [_CTX.Queue() for _ in range(self.world_size)]
        self._procs = [
            _CTX.Process(
                target=_pool_worker,
                args=(rank, self.world_size, port, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()

    def run(self, fn: Callable, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; the list of results in rank order."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for task_queue in self._tasks:
            task_queue.put((fn, args, kwargs))
        answers = _collect(self._results, self.world_size, time.monotonic() + timeout, self._procs)
        try:
            return _raise_failures(fn, answers, self.world_size, timeout)
        except RankFailure:
            self.close()
            raise

    def close(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        self._procs = []


def _fresh_worker(rank, world_size, port, env, init, fn, args, results) -> None:
    _setup_worker(env)
    if init:
        _init_group(rank, world_size, port)
    results.put(_call(rank, fn, args, {}))


def run_on_ranks(
    fn: Callable,
    world_size: int,
    *args,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict | Callable[[int, int], dict] | None = None,
    init: bool = True,
) -> list:
    """Spawn ``world_size`` fresh processes that each run ``fn(*args)``.

    ``env`` (a dict, or ``env(rank, port)`` returning one) is applied before anything else runs;
    with ``init=False`` the function sets up its own process group (``port`` is free for it).
    """
    port = free_port()
    results = _CTX.Queue()
    procs = [
        _CTX.Process(
            target=_fresh_worker,
            args=(
                rank,
                world_size,
                port,
                env(rank, port) if callable(env) else env or {},
                init,
                fn,
                args,
                results,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        answers = _collect(results, world_size, time.monotonic() + timeout, procs)
        return _raise_failures(fn, answers, world_size, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
