"""A process group ``init_distributed`` created is destroyed at a normal exit, so a script that
ends without ``destroy_process_group`` (DeepSpeed's examples do) exits cleanly instead of
aborting as gloo's threads outlive the interpreter; the release is bounded when a peer never
joins an op in flight, and skipped after an uncaught exception."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.multiproc import free_port

SCRIPT = Path(__file__).resolve().parent / "exit_script.py"
ROOT = SCRIPT.parents[2]


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def _run_two_ranks(tmp_path, mode: str) -> list[dict]:
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), str(tmp_path / "seen"), mode],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    start = time.monotonic()
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        finally:
            (tmp_path / "seen.go").touch()  # rank 0 has left: the busy rank 1 may end
        seen = tmp_path / f"seen.{len(results)}"
        results.append(
            {
                "code": proc.returncode,
                "err": err,
                "took": time.monotonic() - start,
                "seen": seen.read_text() if seen.exists() else None,
                "freed": _read(tmp_path / f"seen.freed.{len(results)}"),
            }
        )
    return results


def test_ops_left_in_flight_at_exit_end_cleanly(tmp_path):
    # Without the release both ranks aborted (-6) in 8 runs of 8 on torch 2.13.
    for rank, result in enumerate(_run_two_ranks(tmp_path, "in_flight")):
        assert result["code"] == 0, (rank, result["err"][-2000:])
        assert "terminate called" not in result["err"]
        assert result["seen"] == "released", rank


def test_a_peer_that_never_joins_does_not_hold_the_exit(tmp_path):
    first, second = _run_two_ranks(tmp_path, "unmatched")
    # Rank 0 gives up on its op after EXIT_RELEASE_S (3 s here); without the bound it waited
    # for rank 1, which waits for rank 0 to leave (until the 120 s kill).
    assert first["took"] < 30, first
    assert "exiting without destroying it" in first["err"]
    assert second["code"] == 0 and second["seen"] == "released", second["err"][-2000:]


def test_an_uncaught_exception_exits_at_once_with_its_error(tmp_path):
    for result in _run_two_ranks(tmp_path, "raises"):
        # The error's exit code, or gloo's abort as before: the run failed either way.
        assert result["code"] in (1, -6) and "ValueError: the script failed" in result["err"]
        assert result["seen"] == "alive"


def test_a_script_that_keeps_its_engine_frees_the_group_before_the_process_ends(tmp_path):
    # The script ends without destroying, its engine in a global: zerolap's exit release
    # destroys the group and nothing keeps its object (an engine of data parallelism alone
    # holds no group). Before, zerolap's mesh record and torch.distributed.nn's default
    # arguments (imported after the group existed) kept it to the end: gloo's threads still
    # ran as the process exited, 2 ranks in 2 runs of 2.
    for rank, result in enumerate(_run_two_ranks(tmp_path, "engine")):
        assert result["code"] == 0, (rank, result["err"][-2000:])
        assert result["seen"] == "released", rank
        assert result["freed"] == "freed", rank


def test_a_destroyed_group_is_freed_once_its_engine_is(tmp_path):
    # A program that makes another group after (an elastic restart, a notebook) does not keep
    # the old one's threads and sockets.
    for rank, result in enumerate(_run_two_ranks(tmp_path, "engine_destroyed")):
        assert result["code"] == 0, (rank, result["err"][-2000:])
        assert result["freed"] == "freed", rank
