"""One process of the ``deepspeed`` command (``zerolap.launcher.runner``), run by torchrun as
a script: ``launch.py [--module] [--no-local-rank] --target TARGET args...``.

DeepSpeed's launcher passes ``--local_rank=<r>`` as the first argument of the user's script;
this adds it (from torchrun's ``LOCAL_RANK``) and runs the script, or the module with
``--module``, as ``__main__``. It imports nothing from zerolap, so the user's script is the
first to.
"""

from __future__ import annotations

import os
import runpy
import sys


def run(argv: list[str]) -> None:
    split = argv.index("--target")  # what follows belongs to the user's program
    flags, (target, *target_args) = argv[:split], argv[split + 1 :]
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
