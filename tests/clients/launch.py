"""Run a client script on 2 processes through torchrun, with a hard timeout, and read the JSON
its rank 0 wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["launch"]

HERE = Path(__file__).resolve().parent
ENV = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",  # nothing here is downloaded
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "PYTHONUNBUFFERED": "1",
}


def launch(script: str, result: Path, *args: str, nproc: int = 2, timeout: float = 300) -> dict:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(HERE / script),
        *args,
        "--result",
        str(result),
    ]
    env = {**os.environ, **ENV}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-6000:]
        raise AssertionError(f"{' '.join(command[3:])} exited {done.returncode}:\n{tail}")
    return json.loads(result.read_text())
