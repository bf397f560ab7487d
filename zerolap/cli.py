"""The ``zerolap`` command: demo, run, bench, estimate, consolidate, report."""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import subprocess
import sys
from pathlib import Path

from zerolap.profiling.estimate import PRECISIONS

__all__ = ["main"]


BENCHMARKS = ("comm_bench", "zero_bench", "checkpoint_bench", "offload_bench", "tp_bench")


class CliError(Exception):
    """A bad argument: printed as ``zerolap: ...`` with exit status 2."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch_local(fn, nprocs: int, *args) -> None:
    """Run ``fn(*args)`` on ``nprocs`` local processes through torch's elastic launcher."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"zerolap-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.5,
    )
    elastic_launch(config, fn)(*args)


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise CliError(f"{name} must be >= 1, got {value}")
    return value


def _demo(args: argparse.Namespace) -> int:
    from zerolap.demo.train import MODEL_SIZES, DemoOptions, run_demo

    _positive("--world-size", args.world_size)
    _positive("--steps", args.steps)
    if args.stage not in (0, 1, 2, 3):
        raise CliError(f"--stage must be 0, 1, 2 or 3, got {args.stage}")
    if args.model_size not in MODEL_SIZES:
        raise CliError(f"--model-size must be one of {', '.join(MODEL_SIZES)}")
    if args.config and not Path(args.config).is_file():
        raise CliError(f"--config {args.config}: no such file")
    _positive("--tp", args.tp)
    if args.world_size % args.tp:
        raise CliError(f"--tp {args.tp} does not divide --world-size {args.world_size}")
    if args.config and (args.tp > 1 or args.tp_overlap):
        raise CliError(
            "--tp and --tp-overlap build the config; with --config, set its "
            "tensor_parallel section instead"
        )
    # Stage 3 does not take the full overlap (a config error); it gets the backward one.
    overlap = args.tp_overlap or ("backward" if args.stage == 3 else "full")
    options = DemoOptions(
        stage=args.stage,
        steps=args.steps,
        model_size=args.model_size,
        config=args.config,
        out_dir=args.out,
        offload=args.offload,
        tp=args.tp,
        tp_overlap=overlap,
    )
    _launch_local(run_demo, args.world_size, options)
    return 0


def _run(args: argparse.Namespace) -> int:
    """Hand over to torchrun with the translated flags."""
    from torch.distributed import run as torchrun

    from zerolap.launcher.runner import torchrun_argv

    _positive("-n/--nproc-per-node", args.nproc_per_node)
    if not 1 <= args.master_port <= 65535:
        raise CliError(
            f"--master-port must be a port in 1..65535, got {args.master_port}: "
            "every rank connects to it"
        )
    if not Path(args.script).is_file():
        raise CliError(f"{args.script}: no such script")
    launch = torchrun_argv(
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
    )
    torchrun.main([*launch, args.script, *args.script_args])
    return 0


def _benchmark_script(name: str) -> Path:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    if not path.is_file():
        raise CliError(
            f"{path} not found: the benchmarks ship with zerolap's source tree, run "
            "`zerolap bench` from a checkout"
        )
    return path


def _bench(args: argparse.Namespace) -> int:
    # Each benchmark runs as its own script, as documented, so that the ranks it spawns can
    # import it by its file like any other script.
    extra = ["--quick"] if args.quick else []
    status = 0
    for name in args.which:
        print(f"\n## {name}\n", flush=True)
        script = _benchmark_script(name)
        status |= subprocess.call([sys.executable, str(script), *extra], cwd=script.parent.parent)
    return status


def _count_params(target: str) -> int:
    module_name, _, factory_name = target.partition(":")
    if not module_name or not factory_name:
        raise CliError(f"--model must look like module:factory, got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module of the user's project, as uvicorn does
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as err:
        raise CliError(f"--model {target}: {err}") from None
    return sum(p.numel() for p in factory().parameters())


def _estimate(args: argparse.Namespace) -> int:
    from zerolap.profiling.estimate import estimate_offload

    if (args.params is None) == (args.model is None):
        raise CliError("give exactly one of --params N and --model module:factory")
    numel = args.params if args.params is not None else _count_params(args.model)
    try:
        per_device = estimate_offload(numel, args.world, args.precision)
    except ValueError as err:
        raise CliError(str(err)) from None
    print(
        f"model states per device: {numel:,.0f} parameters, {args.world} data-parallel "
        f"ranks, {args.precision} precision (Adam)"
    )
    print(
        f"  {'':13} {'no offload':>13}   {'offload cpu: device':>19} {'+ host':>13}"
        f"   {'offload nvme: device':>20} {'+ host':>13} {'+ disk':>13}"
    )
    for stage, tiers in per_device.items():
        if "none" not in tiers:
            print(f"  ZeRO stage {stage}: ({args.precision} needs stage 1-3)")
            continue
        row = f"  ZeRO stage {stage}: {_decimal_bytes(tiers['none'].device)}"
        if "cpu" in tiers:
            cpu, nvme = tiers["cpu"], tiers["nvme"]
            row += (
                f"   {_decimal_bytes(cpu.device):>19} {_decimal_bytes(cpu.host)}"
                f"   {_decimal_bytes(nvme.device):>20} {_decimal_bytes(nvme.host)}"
                f" {_decimal_bytes(nvme.disk)}"
            )
        elif stage == 0:
            row += "   (offload needs stage 1-3)"
        else:
            row += f"   ({args.precision}: no offload)"
        print(row)
    print(
        "  (from an accelerator: an fp32 master on the host even for fp32 weights, the gradient "
        "shard on the host at stages 2-3, and at stage 3 the parameter shards too: offload_param)"
    )
    return 0


def _decimal_bytes(nbytes: float) -> str:
    """In the unit that keeps the number readable, decimal as in the ZeRO paper."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:10.3f} {unit}"
    return f"{nbytes:10.0f} B"


def _consolidate(args: argparse.Namespace) -> int:
    import torch

    from zerolap.checkpoint import CheckpointError, get_fp32_state_dict

    try:
        state = get_fp32_state_dict(args.checkpoint_dir, tag=args.tag)
    except CheckpointError as err:
        raise CliError(str(err)) from None
    torch.save(state, args.output)
    numel = sum(t.numel() for t in state.values())
    print(f"wrote {len(state)} tensors ({numel:,} elements, fp32) to {args.output}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from zerolap.report import environment_report

    rows = environment_report()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
    return 0


def report_main() -> int:
    """``ds_report`` (installed by the deepspeed shim): ``zerolap report``."""
    return main(["report"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerolap", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo", help="train a small GPT on local processes and show memory, bytes and overlap"
    )
    demo.add_argument("--stage", type=int, default=2, help="ZeRO stage 0-3 (default 2)")
    demo.add_argument("--world-size", type=int, default=2, help="processes (default 2)")
    demo.add_argument("--steps", type=int, default=450, help="optimizer steps (default 450)")
    demo.add_argument("--model-size", default="tiny", help="tiny or small (default tiny)")
    demo.add_argument("--config", help="a ds_config JSON to use instead of the built-in one")
    demo.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    demo.add_argument(
        "--offload",
        default="none",
        choices=["none", "cpu", "nvme"],
        help="offload_optimizer (and offload_param at stage 3); nvme swaps to <out>/swap",
    )
    demo.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel size, dividing --world-size"
    )
    demo.add_argument(
        "--tp-overlap",
        choices=["off", "backward", "full"],
        help="tensor_parallel.overlap with --tp > 1 (default full; backward at stage 3)",
    )
    demo.set_defaults(run=_demo)

    run = commands.add_parser("run", help="launch a training script through torchrun")
    run.add_argument("-n", "--nproc-per-node", type=int, default=1)
    run.add_argument("--nnodes", default="1")
    run.add_argument("--node-rank", type=int, default=0)
    run.add_argument("--master-addr", default="127.0.0.1")
    run.add_argument("--master-port", type=int, default=29500)
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    run.set_defaults(run=_run)

    bench = commands.add_parser("bench", help="run the comm and ZeRO benchmarks")
    bench.add_argument("--quick", action="store_true", help="a short smoke run of each")
    bench.add_argument(
        "--which",
        nargs="+",
        default=["comm_bench", "zero_bench"],
        choices=BENCHMARKS,
    )
    bench.set_defaults(run=_bench)

    estimate = commands.add_parser("estimate", help="model-state memory per device, stages 0-3")
    estimate.add_argument("--params", type=float, help="number of parameters, e.g. 7.5e9")
    estimate.add_argument("--model", help="module:factory returning an nn.Module")
    estimate.add_argument("--world", type=int, default=1, help="data-parallel ranks")
    estimate.add_argument("--precision", default="mixed", choices=list(PRECISIONS))
    estimate.set_defaults(run=_estimate)

    consolidate = commands.add_parser(
        "consolidate", help="one fp32 state dict from a sharded checkpoint"
    )
    consolidate.add_argument("checkpoint_dir")
    consolidate.add_argument("output")
    consolidate.add_argument("--tag", help="default: the one named in 'latest'")
    consolidate.set_defaults(run=_consolidate)

    report = commands.add_parser("report", help="environment report, like ds_report")
    report.set_defaults(run=_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except CliError as err:
        print(f"zerolap: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
