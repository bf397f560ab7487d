"""Latency and bus bandwidth of ``zerolap.comm`` against raw ``torch.distributed`` on gloo.

Run from the repo root: ``python benchmarks/comm_bench.py [--world-sizes 2 4] [--quick]``.

Every op is measured in a *family* of variants that move the same message: torch's collective,
zerolap's wrapper of it and, where there is one, zerolap's ring. Each round runs every variant of
the family once, in an order that rotates, with a barrier before each timed call, so noise on a
busy machine hits all variants alike. A call's time is the slowest rank's; the table shows the
median over rounds, and a ratio is the median over rounds of (variant / torch) in the same round,
which cancels the slow drifts of a noisy machine. Message sizes follow nccl-tests (an
all-gather's message is its output, a reduce-scatter's its input), and so does bus bandwidth
(``zerolap.comm.volume.bus_factor``).
The comms logger stays off, as it is by default, so the wrappers pay only their checks.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from collections.abc import Callable

__all__ = ["main"]

KIB, MIB = 1 << 10, 1 << 20
DEFAULT_SIZES = [4 * KIB * 4**i for i in range(8)]  # 4 KiB .. 64 MiB
QUICK_SIZES = [64 * KIB, 1 * MIB, 4 * MIB]
BIG = 1 * MIB  # sizes from here on count in the summary
# family, message bytes, variant, median seconds, busbw GB/s, median per-round ratio to torch
Row = tuple[str, int, str, float, float, float]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _families(nbytes: int, n: int) -> dict[str, dict[str, Callable[[], object]]]:
    """Per op, the variants to compare: ``{family: {variant: call}}`` on zero-filled fp32
    buffers (zeros stay zeros under in-place sums, so no value drifts into inf or denormals)."""
    import torch
    import torch.distributed as torch_dist

    import zerolap.comm as dist

    numel = nbytes // 4
    whole = torch.zeros(numel)
    piece = torch.zeros(numel // n)
    sum_ = torch_dist.ReduceOp.SUM
    return {
        "all_reduce": {
            "torch": lambda: torch_dist.all_reduce(whole),
            "zerolap": lambda: dist.all_reduce(whole),
            "ring": lambda: dist.ring_all_reduce(whole),
        },
        "all_gather": {
            "torch": lambda: torch_dist.all_gather_single(whole, piece),
            "zerolap": lambda: dist.all_gather_into_tensor(whole, piece),
            "ring": lambda: dist.ring_all_gather(whole),
        },
        "reduce_scatter": {
            "torch": lambda: torch_dist.reduce_scatter_single(piece, whole, sum_),
            "zerolap": lambda: dist.reduce_scatter_tensor(piece, whole),
            "ring": lambda: dist.ring_reduce_scatter(whole),
        },
        "broadcast": {
            "torch": lambda: torch_dist.broadcast(whole, 0),
            "zerolap": lambda: dist.broadcast(whole, 0),
        },
    }


def _time_family(
    variants: dict[str, Callable[[], object]], iters: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds per call, ``[variant][round]``, on this rank; the order rotates each round."""
    import torch.distributed as torch_dist

    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + iters):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            torch_dist.barrier()
            start = time.perf_counter()
            variants[name]()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[name].append(elapsed)
    return times


def iters_for(nbytes: int, iters: int) -> int:
    """Fewer rounds above 2 MiB (a 64 MiB round costs about a second), never fewer than 15."""
    return max(min(iters, 15), min(iters, iters * 2 * MIB // max(nbytes, 1)))


def _worker(rank: int, n: int, port: int, sizes: list[int], iters: int, warmup: int, out) -> None:
    import torch
    import torch.distributed as torch_dist

    import zerolap.comm as dist
    from zerolap.comm.volume import bus_factor

    torch.set_num_threads(1)
    dist.init_distributed(
        dist_backend="gloo",
        rank=rank,
        world_size=n,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=300,
        verbose=False,
    )
    for nbytes in sizes:
        rows: list[Row] = []
        for family, variants in _families(nbytes, n).items():
            times = _time_family(variants, iters_for(nbytes, iters), warmup)
            slowest = torch.tensor([times[name] for name in variants], dtype=torch.float64)
            torch_dist.all_reduce(slowest, torch_dist.ReduceOp.MAX)  # a call ends on its last rank
            per_round = dict(zip(variants, slowest.tolist(), strict=True))
            for name, seconds in per_round.items():
                median = statistics.median(seconds)
                busbw = nbytes / median / 1e9 * bus_factor(family, n)
                ratios = [t / ref for t, ref in zip(seconds, per_round["torch"], strict=True)]
                rows.append((family, nbytes, name, median, busbw, statistics.median(ratios)))
        if rank == 0:
            print(f"  [world {n}] {_human(nbytes)} done", file=sys.stderr, flush=True)
            out.put(rows)
    dist.destroy_process_group()


def measure(n: int, sizes: list[int], iters: int, warmup: int) -> list[Row]:
    """Spawn ``n`` gloo ranks on localhost and return rank 0's rows."""
    import torch.multiprocessing as tmp

    results = tmp.get_context("spawn").SimpleQueue()
    args = (n, _free_port(), sizes, iters, warmup, results)
    context = tmp.spawn(_worker, args=args, nprocs=n, join=False)
    rows: list[Row] = []
    while not context.join(timeout=0.5):  # raises with the failing rank's traceback
        while not results.empty():
            rows += results.get()
    while not results.empty():
        rows += results.get()
    return rows


def _human(nbytes: int) -> str:
    for unit, name in ((MIB, "MiB"), (KIB, "KiB")):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit} {name}"
    return f"{nbytes} B"


# family -> the names of its variants as the table shows them
NAMES = {
    "all_reduce": {"torch": "all_reduce", "zerolap": "all_reduce", "ring": "ring_all_reduce"},
    "all_gather": {
        "torch": "all_gather_single",
        "zerolap": "all_gather_into_tensor",
        "ring": "ring_all_gather",
    },
    "reduce_scatter": {
        "torch": "reduce_scatter_single",
        "zerolap": "reduce_scatter_tensor",
        "ring": "ring_reduce_scatter",
    },
    "broadcast": {"torch": "broadcast", "zerolap": "broadcast"},
}


def report(n: int, rows: list[Row]) -> str:
    """The table for one world size, then the summary over sizes >= 1 MiB."""
    by = {(family, nbytes, name): (t, bw) for family, nbytes, name, t, bw, _ in rows}
    head = ("zerolap op", "torch op", "size", "torch ms", "zerolap ms", "ratio")
    head += ("torch busbw GB/s", "zerolap busbw GB/s")
    lines = [
        f"## world size {n} (gloo, localhost, fp32, one torch thread per rank)",
        "",
        "ratio: median over rounds of zerolap/torch in the same round (< 1: zerolap faster)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    big: dict[tuple[str, str], list[float]] = {}  # (variant, family) -> ratios at >= 1 MiB
    for family, nbytes, name, t, bw, ratio in rows:
        if name == "torch":
            continue
        torch_t, torch_bw = by[(family, nbytes, "torch")]
        cells = (NAMES[family][name], NAMES[family]["torch"], _human(nbytes))
        cells += (f"{torch_t * 1e3:.3f}", f"{t * 1e3:.3f}", f"{ratio:.2f}")
        lines.append("| " + " | ".join((*cells, f"{torch_bw:.3f}", f"{bw:.3f}")) + " |")
        if nbytes >= BIG:
            big.setdefault((name, family), []).append(ratio)
    sizes = " / ".join(_human(b) for b in sorted({b for _, b, *_ in rows if b >= BIG}))
    if not sizes:
        return "\n".join(lines)
    worst = max(r - 1 for (name, _), ratios in big.items() if name == "zerolap" for r in ratios)
    verdict = "within" if worst < 0.05 else "ABOVE"
    lines += ["", f"wrapper overhead (ratio - 1) at {sizes}; max {worst:+.1%}, {verdict} 5%:"]
    for (name, family), ratios in big.items():
        if name == "zerolap":
            each = " ".join(f"{r - 1:+.1%}" for r in ratios)
            lines.append(f"- {NAMES[family][name]}: {each} (max {max(ratios) - 1:+.1%})")
    lines += ["", f"ring speed vs gloo's op (torch ms / ring ms, > 1: ring faster) at {sizes}:"]
    for (name, family), ratios in big.items():
        if name == "ring":
            each = " ".join(f"{1 / r:.2f}x" for r in ratios)
            lines.append(f"- {NAMES[family][name]} vs {NAMES[family]['torch']}: {each}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", help="message sizes in bytes")
    parser.add_argument(
        "--iters", type=int, default=60, help="timed rounds per size (fewer above 2 MiB)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before timing")
    parser.add_argument("--quick", action="store_true", help="3 sizes, 8 rounds: a smoke run")
    return parser


def _wrapper_cost_main(out) -> None:
    """World size 1, where a collective does almost nothing: the difference between zerolap's
    call and torch's is the wrapper's own cost (checks, handle, logging branch)."""
    import torch
    import torch.distributed as torch_dist

    import zerolap.comm as dist

    torch.set_num_threads(1)
    dist.init_distributed(dist_backend="gloo", verbose=False)
    t, flat = torch.ones(1 << 18), torch.empty(1 << 18)
    gather = getattr(torch_dist, "all_gather_single", torch_dist.all_gather_into_tensor)
    scatter = getattr(torch_dist, "reduce_scatter_single", torch_dist.reduce_scatter_tensor)
    pairs = {
        "all_reduce": (lambda: torch_dist.all_reduce(t), lambda: dist.all_reduce(t)),
        "broadcast": (lambda: torch_dist.broadcast(t, 0), lambda: dist.broadcast(t, 0)),
        "all_gather_into_tensor": (
            lambda: gather(flat, t),
            lambda: dist.all_gather_into_tensor(flat, t),
        ),
        "reduce_scatter_tensor": (
            lambda: scatter(flat, t),
            lambda: dist.reduce_scatter_tensor(flat, t),
        ),
    }

    def per_call_us(fn, calls: int = 5000) -> float:
        for _ in range(200):
            fn()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - start) / calls)
        return best * 1e6

    out.put({op: per_call_us(ours) - per_call_us(raw) for op, (raw, ours) in pairs.items()})


def wrapper_cost_us() -> dict[str, float]:
    """Microseconds zerolap adds to each call of each wrapped op (a fresh process)."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_wrapper_cost_main, args=(out,))
    proc.start()
    costs = out.get(timeout=300)
    proc.join()
    return costs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    iters, warmup = (8, 1) if args.quick else (args.iters, args.warmup)
    for n in args.world_sizes:
        bad = [s for s in sizes if s % (4 * n)]
        if bad:
            raise SystemExit(f"sizes {bad} do not split into {n} whole fp32 pieces")
    started = time.perf_counter()
    for n in args.world_sizes:
        print(report(n, measure(n, sizes, iters, warmup)) + "\n", flush=True)
    costs = wrapper_cost_us()
    print("wrapper cost per call (world size 1, tight loop; compare with the latencies above):")
    for op, us in costs.items():
        print(f"- {op}: +{us:.1f} us", flush=True)
    print(f"(total {time.perf_counter() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
