"""The ``deepspeed`` command (installed by the shim in ``compat/``): DeepSpeed's launcher
flags, translated to torchrun.

DeepSpeed's example scripts are started as ``deepspeed [--num_gpus N] train.py args``, and the
launcher puts ``--local_rank=<r>`` before each process's arguments (their parsers expect it),
unless ``--no_local_rank``. Here torchrun starts the processes, each running
``zerolap/launcher/launch.py``, which adds that argument and runs the script (or module, with
``--module``) as ``__main__``.

One node, or several with ``--no_ssh`` (each node runs the command with its ``--node_rank``, as
with DeepSpeed): torchrun's rendezvous joins them. Flags that need DeepSpeed's own multi-node
runners (a hostfile with several hosts, ``--include``/``--exclude``, pdsh, MPI, SLURM
launchers) are refused with a message naming the flag.

``--bind_cores_to_rank`` pins each local rank to an equal share of the physical cores (or of
``--bind_core_list``) and sets ``OMP_NUM_THREADS`` to its size, as DeepSpeed's launcher does
with ``numactl``; here the process binds itself (``os.sched_setaffinity``), so numactl need not
be installed. DeepSpeed's added NUMA memory policy (``numactl -m``) is not applied.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "main", "torchrun_argv"]

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
"""DeepSpeed's file of ``NAME=VALUE`` lines exported to remote nodes by its multi-node runners
(imported by ``accelerate launch --use_deepspeed``); zerolap's launcher starts no remote
processes, so it has nothing to export it to."""

_DEFAULT_PORT = 29500


def torchrun_argv(
    *, nproc_per_node: int, nnodes: str, node_rank: int, master_addr: str, master_port: int
) -> list[str]:
    """torchrun's flags for a static job (also ``zerolap run``'s)."""
    return [
        f"--nproc-per-node={nproc_per_node}",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepspeed",
        description="DeepSpeed's launcher, served by zerolap (torchrun underneath).",
    )
    parser.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1)
    parser.add_argument("--num_nodes", type=int, default=-1)
    parser.add_argument("--node_rank", type=int, default=-1)
    parser.add_argument("--master_addr", default="")
    parser.add_argument("--master_port", type=int, default=_DEFAULT_PORT)
    parser.add_argument("--module", action="store_true")
    parser.add_argument("--no_local_rank", action="store_true")
    parser.add_argument("--no_ssh", action="store_true")
    parser.add_argument("--no_python", action="store_true")
    parser.add_argument("-H", "--hostfile", default=None)
    parser.add_argument("-i", "--include", default="")
    parser.add_argument("-e", "--exclude", default="")
    parser.add_argument("--launcher", default="pdsh")
    parser.add_argument("--bind_cores_to_rank", action="store_true")
    parser.add_argument("--bind_core_list", default=None)
    parser.add_argument("user_script")
    parser.add_argument("user_args", nargs=argparse.REMAINDER)
    return parser


def _refuse(args: argparse.Namespace) -> str | None:
    """Why these flags cannot run here, or None."""
    from zerolap.launcher import launch

    if args.bind_core_list is not None:
        if not args.bind_cores_to_rank:
            return "--bind_core_list needs --bind_cores_to_rank"
        try:
            launch.parse_core_list(args.bind_core_list)
        except ValueError as err:
            return str(err)
    if args.no_python:
        return "--no_python: zerolap's launcher runs Python scripts and modules only"
    if args.include or args.exclude:
        return "--include/--exclude select GPUs on hosts of a hostfile; use CUDA_VISIBLE_DEVICES"
    if args.hostfile is not None and _hosts(args.hostfile) > 1:
        return (
            f"--hostfile {args.hostfile} names several hosts: zerolap does not ssh into them; "
            "run the command on each node with --no_ssh --node_rank R --num_nodes N"
        )
    if args.num_nodes > 1 and not args.no_ssh:
        return "--num_nodes > 1 needs --no_ssh and --node_rank on each node (no pdsh/MPI here)"
    return None


def _hosts(path: str) -> int:
    try:
        with open(path) as hostfile:
            lines = hostfile.read().splitlines()
    except OSError as err:
        raise SystemExit(f"deepspeed: --hostfile {path}: {err.strerror}") from None
    return sum(1 for line in lines if line.strip() and not line.lstrip().startswith("#"))


def _local_processes(requested: int) -> int:
    if requested > 0:
        return requested
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def main(argv: list[str] | None = None) -> int:
    """``deepspeed [flags] script.py [args]``."""
    from torch.distributed import run as torchrun

    from zerolap.launcher import launch

    args = _parser().parse_args(argv)
    problem = _refuse(args)
    if problem is not None:
        print(f"deepspeed (zerolap): {problem}", file=sys.stderr)
        return 2
    nodes = max(args.num_nodes, 1)
    flags = torchrun_argv(
        nproc_per_node=_local_processes(args.num_gpus),
        nnodes=str(nodes),
        node_rank=max(args.node_rank, 0),
        master_addr=args.master_addr or "127.0.0.1",
        master_port=args.master_port,
    )
    rank_flags = ["--module"] if args.module else []
    rank_flags += ["--no-local-rank"] if args.no_local_rank else []
    if args.bind_cores_to_rank:
        rank_flags.append(f"--bind-cores={args.bind_core_list or ''}")
    program = [launch.__file__, *rank_flags, "--target", args.user_script]
    torchrun.main([*flags, *program, *args.user_args])
    return 0


if __name__ == "__main__":
    sys.exit(main())
