"""One process of the ``deepspeed`` command (``zerolap.launcher.runner``), run by torchrun as
a script: ``launch.py [--module] [--no-local-rank] [--bind-cores[=LIST]] --target TARGET
args...``.

DeepSpeed's launcher passes ``--local_rank=<r>`` as the first argument of the user's script;
this adds it (from torchrun's ``LOCAL_RANK``) and runs the script, or the module with
``--module``, as ``__main__``. It imports nothing from zerolap, so the user's script is the
first to, and binding to cores (``--bind_cores_to_rank``) happens before torch is imported and
reads ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

_BIND = "--bind-cores"


def parse_core_list(text: str) -> list[int]:
    """DeepSpeed's ``--bind_core_list`` form: ``0-7,16-23`` (ascending, not overlapping)."""
    cores: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            span = range(int(first), int(last or first) + 1)
        except ValueError:
            raise ValueError(f"--bind_core_list {text!r}: {part!r} is not N or N-M") from None
        if not span or (cores and span[0] <= cores[-1]):
            raise ValueError(
                f"--bind_core_list {text!r}: ranges must ascend without overlapping ({part!r})"
            )
        cores.extend(span)
    return cores


def physical_cores() -> list[int]:
    """The cores this process may run on, one logical CPU per physical core (hyperthread
    siblings share a core's units, so DeepSpeed binds to physical cores only)."""
    allowed = sorted(os.sched_getaffinity(0))
    kept = []
    for cpu in allowed:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            first_sibling = min(set(parse_core_list(siblings.read_text())) & set(allowed))
        except (OSError, ValueError):  # no topology to read: every CPU counts as a core
            first_sibling = cpu
        if first_sibling == cpu:
            kept.append(cpu)
    return kept


def rank_cores(cores: list[int], local_ranks: int, local_rank: int) -> list[int]:
    """This rank's equal share of ``cores``, in order (leftover cores stay unused)."""
    per_rank = len(cores) // local_ranks
    if per_rank < 1:
        raise ValueError(
            f"--bind_cores_to_rank: {len(cores)} core(s) for {local_ranks} local ranks; "
            "each rank needs at least one"
        )
    return cores[per_rank * local_rank : per_rank * (local_rank + 1)]


def bind(core_list: str | None) -> None:
    """Pin this process to its share of the cores and size OpenMP's pool to it."""
    cores = parse_core_list(core_list) if core_list else physical_cores()
    mine = rank_cores(cores, int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
    if missing := sorted(set(mine) - os.sched_getaffinity(0)):
        raise ValueError(f"--bind_core_list: this machine does not let the job use cores {missing}")
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))


def run(argv: list[str]) -> None:
    split = argv.index("--target")  # what follows belongs to the user's program
    flags, (target, *target_args) = argv[:split], argv[split + 1 :]
    for flag in flags:
        if flag == _BIND or flag.startswith(f"{_BIND}="):
            bind(flag.partition("=")[2] or None)
    local_rank = (
        [] if "--no-local-rank" in flags else [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}"]
    )
    sys.argv = [target, *local_rank, *target_args]
    if "--module" in flags:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` would
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    run(sys.argv[1:])
