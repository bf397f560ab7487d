"""The ``deepspeed`` command on zerolap: DeepSpeed's launcher flags, each process given
``--local_rank`` first as DeepSpeed's launcher does, flags needing DeepSpeed's multi-node
runners refused with a message naming them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc import free_port
from zerolap.launcher.launch import parse_core_list, physical_cores, rank_cores
from zerolap.launcher.runner import main

HERE = Path(__file__).resolve().parent


def _launch(tmp_path, *flags: str) -> list[dict]:
    command = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    assert command, "the shim's deepspeed command is not installed: run make"
    out = tmp_path / "seen"
    # A rank that aborts prints every thread's Python stack (a rare abort at exit, gloo's
    # "terminate called without an active exception", has been seen here: where was each
    # thread?).
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    done = subprocess.run(
        [command, *flags, "--master_port", str(free_port()),
         str(HERE / "ds_script.py"), "--out", str(out)],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-8000:]
    return [json.loads(path.read_text()) for path in sorted(tmp_path.glob("seen.*"))]


def test_the_deepspeed_command_launches_a_deepspeed_script(tmp_path):
    seen = _launch(tmp_path, "--num_gpus", "2")
    assert [s["local_rank_arg"] for s in seen] == [0, 1]
    assert all(s["world"] == 2 and s["steps"] == 2 for s in seen)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--num_nodes", "2"], "--num_nodes > 1 needs --no_ssh"),
        (["--include", "localhost:0"], "--include/--exclude"),
        (["--no_python"], "--no_python"),
    ],
)
def test_flags_that_need_deepspeeds_runners_are_refused(capsys, flags, named):
    assert main([*flags, "train.py"]) == 2
    assert named in capsys.readouterr().err


def test_a_hostfile_with_several_hosts_is_refused(tmp_path, capsys):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    assert main(["--hostfile", str(hostfile), "train.py"]) == 2
    assert "names several hosts" in capsys.readouterr().err


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable CPUs")
def test_bind_cores_to_rank_gives_each_rank_its_share_and_sizes_openmp(tmp_path):
    first, second = sorted(os.sched_getaffinity(0))[:2]
    seen = _launch(
        tmp_path, "--num_gpus", "2", "--bind_cores_to_rank", "--bind_core_list",
        f"{first},{second}",
    )  # fmt: skip
    assert [s["cores"] for s in seen] == [[first], [second]]
    assert [(s["omp_threads"], s["torch_threads"]) for s in seen] == [("1", 1), ("1", 1)]


def test_bind_cores_to_rank_without_a_list_takes_the_physical_cores(tmp_path):
    (seen,) = _launch(tmp_path, "--num_gpus", "1", "--bind_cores_to_rank")
    assert seen["cores"] == physical_cores()
    assert seen["omp_threads"] == str(len(physical_cores()))


def test_core_lists_parse_as_deepspeed_writes_them():
    assert parse_core_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    for bad in ("3-1", "0-3,2", "a", "0-3,,5"):
        with pytest.raises(ValueError, match="--bind_core_list"):
            parse_core_list(bad)


def test_cores_are_shared_equally_in_order():
    assert rank_cores([0, 1, 2, 3, 4], 2, 0) == [0, 1]
    assert rank_cores([0, 1, 2, 3, 4], 2, 1) == [2, 3]
    with pytest.raises(ValueError, match="2 core\\(s\\) for 3 local ranks"):
        rank_cores([0, 1], 3, 0)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--bind_core_list", "0-1"], "--bind_core_list needs --bind_cores_to_rank"),
        (["--bind_cores_to_rank", "--bind_core_list", "4-2"], "ranges must ascend"),
    ],
)
def test_bad_binding_flags_are_refused_before_launch(capsys, flags, named):
    assert main([*flags, "train.py"]) == 2
    assert named in capsys.readouterr().err
