"""The ``deepspeed`` command on zerolap: DeepSpeed's launcher flags, each process given
``--local_rank`` first as DeepSpeed's launcher does, flags needing DeepSpeed's multi-node
runners refused with a message naming them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc import free_port
from zerolap.launcher.runner import main

HERE = Path(__file__).resolve().parent


def test_the_deepspeed_command_launches_a_deepspeed_script(tmp_path):
    command = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    assert command, "the shim's deepspeed command is not installed: run make"
    out = tmp_path / "seen"
    done = subprocess.run(
        [command, "--num_gpus", "2", "--master_port", str(free_port()),
         str(HERE / "ds_script.py"), "--out", str(out)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [json.loads((tmp_path / f"seen.{r}").read_text()) for r in range(2)]
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
