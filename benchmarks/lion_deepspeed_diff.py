"""DeepSpeed 0.19.8's CPU Lion (its compiled AVX kernel) against zerolap's (torch's foreach
kernels): the same steps on the same tensors, side by side.

Run from the repo root: ``python benchmarks/lion_deepspeed_diff.py --deepspeed-python
/tmp/dsenv/bin/python [--numel 4000000] [--steps 5]`` (``benchmarks/deepspeed_diff.py
--make-env`` makes that environment; DeepSpeed builds its ``cpu_lion`` op on first use, about
a minute). One thread each. A parameter of ``--numel`` elements whose first 1024 never get a
gradient takes ``--steps`` steps (lr 1e-3, betas 0.9 / 0.99, weight decay 0.1) from both
classes. Printed: the largest difference where gradients flowed and how many elements differ
(a direction within rounding of zero may take either sign), how far the never-touched elements
moved in each (weight decay alone moves them by a factor 1 - lr wd per step), and the median
step time of each, on the whole tensor and on pieces of the engine's size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNTOUCHED = 1024
PIECE = 1 << 18


def run(numel: int, steps: int, out: str) -> None:
    """Both libraries run this: ``deepspeed.ops.lion.DeepSpeedCPULion`` is whichever one
    ``import deepspeed`` gives."""
    import statistics
    import time

    import torch
    from deepspeed.ops.lion import DeepSpeedCPULion

    torch.set_num_threads(1)
    start = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    param = torch.nn.Parameter(start.clone())
    optimizer = DeepSpeedCPULion([param], lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    # The same update over pieces of the engine's size (zero.sub_groups.STEP_PIECE_NUMEL),
    # timed apart: how the engine steps an offloaded or CPU shard.
    pieces = [torch.nn.Parameter(p.clone()) for p in start.split(PIECE)]
    in_pieces = DeepSpeedCPULion(pieces, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    times, piece_times = [], []
    for step in range(steps):
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(1 + step))
        grad[:UNTOUCHED] = 0.0
        param.grad = grad
        begin = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - begin)
        for piece, g in zip(pieces, grad.split(PIECE), strict=True):
            piece.grad = g
        begin = time.perf_counter()
        in_pieces.step()
        piece_times.append(time.perf_counter() - begin)
    torch.save({"param": param.detach(), "start": start}, out)
    step_s, piece_s = statistics.median(times[1:]), statistics.median(piece_times[1:])
    print(json.dumps({"step_s": step_s, "piece_s": piece_s}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed-python", required=True)
    parser.add_argument("--numel", type=int, default=4_000_000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--run", help=argparse.SUPPRESS)  # the side each python runs
    args = parser.parse_args()
    if args.run:
        run(args.numel, args.steps, args.run)
        return 0
    import torch

    results, times, piece_times = {}, {}, {}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        for name, python in (
            ("DeepSpeed 0.19.8", args.deepspeed_python),
            ("zerolap", sys.executable),
        ):
            out = str(Path(tmp) / f"{name}.pt")
            sizes = ["--numel", str(args.numel), "--steps", str(args.steps)]
            script = str(Path(__file__).resolve())
            command = [python, script, "--deepspeed-python", python, *sizes, "--run", out]
            done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp)
            if done.returncode != 0:
                raise SystemExit(f"{name}:\n{(done.stdout + done.stderr)[-3000:]}")
            timing = json.loads(done.stdout.strip().splitlines()[-1])
            times[name], piece_times[name] = timing["step_s"], timing["piece_s"]
            results[name] = torch.load(out)
    ds, zl = results["DeepSpeed 0.19.8"]["param"], results["zerolap"]["param"]
    start = results["zerolap"]["start"]
    decayed = start[:UNTOUCHED] * (1 - 1e-3 * 0.1) ** args.steps
    gap = (ds[UNTOUCHED:] - zl[UNTOUCHED:]).abs()
    flowed, apart = gap.max().item(), int((gap > 1e-6).sum())
    moved = {
        name: (r["param"][:UNTOUCHED] - decayed).abs().max().item() for name, r in results.items()
    }
    print(f"{args.numel:,} elements, {args.steps} steps, one thread each\n")
    print("| | DeepSpeed 0.19.8 | zerolap |")
    print("|---|---|---|")
    print(
        f"| where gradients flowed: largest difference; elements more than 1e-6 apart | "
        f"{flowed:.1e}; {apart} of {args.numel - UNTOUCHED:,} | |"
    )
    print(
        f"| never-touched elements: largest move beyond weight decay | "
        f"{moved['DeepSpeed 0.19.8']:.2e} | {moved['zerolap']:.2e} |"
    )
    for label, timed in (("one tensor", times), (f"pieces of {PIECE:,}", piece_times)):
        ds_ms, zl_ms = timed["DeepSpeed 0.19.8"] * 1e3, timed["zerolap"] * 1e3
        print(f"| step time, {label} | {ds_ms:.1f} ms | {zl_ms:.1f} ms ({zl_ms / ds_ms:.2f}x) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
