"""The watchdog names the rank a blocked wait is waiting for, long before the process group's
timeout: a stopped rank, a rank alive but elsewhere, and a rank blocked in a collective while
another waits at a check-in (a call every rank must make), where both fail at once."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import zerolap.comm as dist
from tests.logs import captured_logs
from tests.multiproc import run_on_ranks

FAST = {"ZEROLAP_WATCHDOG_INTERVAL": "0.5", "ZEROLAP_WATCHDOG_REPORT": "2"}


def stopped_rank_is_named() -> dict:
    """Rank 1 stops itself (SIGSTOP) before an all-reduce; rank 0 is told which rank is
    missing, then wakes it (SIGCONT) and the all-reduce completes with the right sum."""
    rank = dist.get_rank()
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    out = torch.full((4,), float(rank + 1))
    if rank == 1:
        dist.all_reduce(out)
        return {"sum": out.tolist()}
    with captured_logs() as logs:
        start = time.monotonic()
        reported = threading.Event()

        def wake_when_reported():
            while not any("rank 1 has sent no heartbeat" in line for line in logs):
                time.sleep(0.1)
            reported.set()
            os.kill(pids[1], signal.SIGCONT)

        threading.Thread(target=wake_when_reported, daemon=True).start()
        dist.all_reduce(out)
        took = time.monotonic() - start
    return {"sum": out.tolist(), "took": took, "logs": logs, "reported": reported.is_set()}


def test_a_stopped_rank_is_named_long_before_the_timeout():
    first, second = run_on_ranks(stopped_rank_is_named, 2, env=FAST, timeout=60)
    assert first["reported"] and first["sum"] == second["sum"] == [3.0] * 4
    assert first["took"] < 10, first  # the process group's timeout in tests is 45 s
    report = next(line for line in first["logs"] if "no heartbeat" in line)
    assert (
        report.startswith("WARNING: rank 0 has waited") and "all_reduce on ranks [0, 1]" in report
    )
    assert "stopped (SIGSTOP), hung outside Python, or dead" in report


def busy_rank_is_named() -> list[str]:
    """Rank 1 computes for 5 s before joining: rank 0's report says it is alive and in no
    collective."""
    with captured_logs() as logs:
        if dist.get_rank() == 1:
            time.sleep(5)  # the report is due after 2 s
        dist.barrier()
    return logs


def test_a_rank_alive_elsewhere_is_named():
    logs = run_on_ranks(busy_rank_is_named, 2, env=FAST, timeout=60)[0]
    assert any("rank 1 is alive and in no collective" in line for line in logs), logs


def check_in_on_one_rank() -> str:
    """Rank 0 checks in alone while rank 1 waits in an all-reduce: both fail within a few
    intervals, each naming the other side."""
    start = time.monotonic()
    with pytest.raises(dist.CheckInError if dist.get_rank() == 0 else dist.CommError) as error:
        if dist.get_rank() == 0:
            dist.check_in("save_checkpoint")
        else:
            dist.all_reduce(torch.ones(2))
    assert time.monotonic() - start < 10
    time.sleep(3)  # the other side may still be reading rank 0's store to reach its verdict
    return str(error.value)


def test_a_call_made_on_one_rank_only_fails_fast_on_both():
    first, second = run_on_ranks(check_in_on_one_rank, 2, env=FAST, timeout=60)
    assert (
        "save_checkpoint must be called on every rank of [0, 1]: rank 1 waits in all_reduce"
        in first
    )
    assert "rank 0 is in save_checkpoint, which every rank of [0, 1] must call" in second


def check_ins_that_meet() -> float:
    """The same check-in on both ranks, one of them late: both return, and the group works."""
    if dist.get_rank() == 1:
        time.sleep(1)
    for _ in range(3):
        dist.check_in("save_checkpoint")
    out = torch.ones(2)
    dist.all_reduce(out)
    return out[0].item()


def test_check_ins_on_every_rank_meet():
    assert run_on_ranks(check_ins_that_meet, 2, env=FAST, timeout=60) == [2.0, 2.0]
