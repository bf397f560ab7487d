"""Checkpoint save/load time and consolidation peak memory against model size (not a test).

For each size, a 2-rank ZeRO engine (stage 2, or ``--stage``; gloo, fp32 AdamW) trains one step,
saves, and a fresh engine loads the checkpoint; then a separate process consolidates it to one
fp32 state dict while its peak RSS is read. Peak memory is reported above the process's baseline
(Python, torch and zerolap imported) and against the size of the output, which any consolidation
must hold. Stage-3 files are smaller: the module states hold no parameters (the optimizer shards'
fp32 values are their only copy).

    python benchmarks/checkpoint_bench.py [--sizes 256 1024 2048] [--stage 3] [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

MIB = 1 << 20


def _model(width: int):
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(8)]
    return torch.nn.Sequential(*layers)


def _rank_main(rank: int, width: int, stage: int, path: str, port: int, out) -> None:
    import torch

    import zerolap
    import zerolap.comm as dist
    from zerolap.zero.status import full_numel

    torch.set_num_threads(1)
    dist.init_distributed(
        dist_backend="gloo",
        rank=rank,
        world_size=2,
        verbose=False,
        init_method=f"tcp://127.0.0.1:{port}",
    )
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2_000_000},
    }
    engine, *_ = zerolap.initialize(model=_model(width), config=config)
    engine.backward(engine(torch.randn(4, width)).pow(2).mean())
    engine.step()
    dist.barrier()
    start = time.perf_counter()
    engine.save_checkpoint(path)
    saved = time.perf_counter() - start
    fresh, *_ = zerolap.initialize(model=_model(width), config=config)
    dist.barrier()
    start = time.perf_counter()
    fresh.load_checkpoint(path)
    loaded = time.perf_counter() - start
    if rank == 0:
        out.put((saved, loaded, sum(full_numel(p) for p in engine.params)))


def _anon_bytes() -> int:
    """Anonymous resident memory: what the process allocated, not the shard files' pages that
    its memory maps keep in the page cache (reclaimable, and counted by ru_maxrss)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


class _AnonPeak(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = _anon_bytes(), True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, _anon_bytes())
            time.sleep(0.001)


def _consolidate_main(path: str, out) -> None:
    import torch  # noqa: F401  (the baseline includes torch)

    from zerolap.checkpoint import get_fp32_state_dict

    baseline_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    baseline_anon = _anon_bytes()
    sampler = _AnonPeak()
    sampler.start()
    start = time.perf_counter()
    state = get_fp32_state_dict(path)
    seconds = time.perf_counter() - start
    sampler.running = False
    sampler.join()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline_rss
    largest = max(t.numel() * t.element_size() for t in state.values())
    output = sum(t.numel() * t.element_size() for t in state.values())
    out.put((seconds, sampler.peak - baseline_anon, peak_rss, output, largest))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(width: int, stage: int = 2) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        procs = [
            ctx.Process(target=_rank_main, args=(r, width, stage, tmp, port, out)) for r in range(2)
        ]
        for p in procs:
            p.start()
        saved, loaded, numel = out.get(timeout=600)
        for p in procs:
            p.join()
        proc = ctx.Process(target=_consolidate_main, args=(tmp, out))
        proc.start()
        seconds, peak_anon, peak_rss, output, largest = out.get(timeout=600)
        proc.join()
        files = sum(f.stat().st_size for f in Path(tmp).rglob("*.pt"))
    return dict(
        width=width,
        numel=numel,
        save_s=saved,
        load_s=loaded,
        files_mib=files / MIB,
        consolidate_s=seconds,
        anon_mib=peak_anon / MIB,
        rss_mib=peak_rss / MIB,
        output_mib=output / MIB,
        largest_mib=largest / MIB,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[512, 1024, 2048],
        help="layer widths (8 square layers each)",
    )
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=2, help="ZeRO stage")
    parser.add_argument("--quick", action="store_true", help="one small size")
    args = parser.parse_args(argv)
    widths = [256] if args.quick else args.sizes
    print(
        "| params | files MiB | save s | load s | consolidate s | output MiB | largest param MiB"
        " | peak allocated MiB (anon) | anon / (output + largest) | peak RSS incl. mapped files"
        " MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for width in widths:
        r = measure(width, args.stage)
        ratio = r["anon_mib"] / (r["output_mib"] + r["largest_mib"])
        print(
            f"| {r['numel'] / 1e6:.1f}M | {r['files_mib']:.0f} | {r['save_s']:.2f} | "
            f"{r['load_s']:.2f} | {r['consolidate_s']:.2f} | {r['output_mib']:.0f} | "
            f"{r['largest_mib']:.1f} | {r['anon_mib']:.0f} | {ratio:.2f} | {r['rss_mib']:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
