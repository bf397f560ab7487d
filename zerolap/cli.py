"""The ``zerolap`` command."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(fn, nprocs: int) -> None:
    """Run ``fn`` on ``nprocs`` local processes through torch's elastic launcher (torchrun)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        run_id=f"zerolap-{os.getpid()}",
        max_restarts=0,
        monitor_interval=0.5,
    )
    elastic_launch(config, fn)()


def _demo(args: argparse.Namespace) -> int:
    from zerolap.demo_comm import comm_tour

    _launch(comm_tour, args.world_size)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerolap", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the demo on local processes")
    demo.add_argument("--world-size", type=int, default=2, help="number of processes (default 2)")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "world_size", 1) < 1:
        print(f"zerolap: --world-size must be >= 1, got {args.world_size}", file=sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
