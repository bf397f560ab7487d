"""DeepSpeed 0.19.8's learning-rate schedules against zerolap's: the lr and betas each sets in
every param group, iteration by iteration, from the same arguments.

Run from the repo root: ``python benchmarks/schedule_deepspeed_diff.py --deepspeed-python
/tmp/dsenv/bin/python [--iterations 60]`` (``benchmarks/deepspeed_diff.py --make-env`` makes
that environment). Each side builds ``deepspeed.runtime.lr_schedules.<schedule>`` over a torch
AdamW (betas 0.9 / 0.999, two param groups) and records the groups' lr and betas after the
constructor (iteration -1) and after each ``step()``. Printed per case: the largest lr and beta1
difference, and the beta2 each leaves (DeepSpeed's OneCycle sets it to 0.99; zerolap keeps the
optimizer's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = {  # name -> (schedule, params)
    "WarmupLR log": (
        "WarmupLR",
        {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 20},
    ),
    "WarmupDecayLR linear": (
        "WarmupDecayLR",
        {"total_num_steps": 50, "warmup_num_steps": 10, "warmup_type": "linear"},
    ),
    "WarmupCosineLR": ("WarmupCosineLR", {"total_num_steps": 50, "warmup_num_steps": 10}),
    "LRRangeTest": ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 7}),
    "LRRangeTest staircase": (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": 1e-4,
            "lr_range_test_step_size": 7,
            "lr_range_test_staircase": True,
        },
    ),
    "OneCycle": (
        "OneCycle",
        {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 15},
    ),
    "OneCycle asymmetric, decay": (
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-2,
            "cycle_first_step_size": 10,
            "cycle_second_step_size": 17,
            "decay_step_size": 5,
            "decay_lr_rate": 0.1,
            "decay_mom_rate": 0.01,
        },
    ),
    "OneCycle stairs": (
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-2,
            "cycle_first_step_size": 12,
            "cycle_second_step_size": 9,
            "cycle_first_stair_count": 4,
            "cycle_second_stair_count": 3,
        },
    ),
}


def run(iterations: int, out: str) -> None:
    """Both libraries run this: ``deepspeed`` is whichever one the python imports."""
    import torch
    from deepspeed.runtime import lr_schedules

    results = {}
    for name, (schedule, params) in CASES.items():
        groups = [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in (0.1, 0.2)]
        optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.999))
        scheduler = getattr(lr_schedules, schedule)(optimizer, **params)
        seen = []
        for i in range(-1, iterations):
            if i >= 0:
                scheduler.step()
            seen.append(
                [[float(g["lr"]), *(float(b) for b in g["betas"])] for g in optimizer.param_groups]
            )
        results[name] = seen
    Path(out).write_text(json.dumps(results))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed-python", required=True)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--run", help=argparse.SUPPRESS)  # the side each python runs
    args = parser.parse_args()
    if args.run:
        run(args.iterations, args.run)
        return 0
    results = {}
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        for name, python in (("deepspeed", args.deepspeed_python), ("zerolap", sys.executable)):
            out = str(Path(tmp) / f"{name}.json")
            script = str(Path(__file__).resolve())
            command = [python, script, "--deepspeed-python", python]
            command += ["--iterations", str(args.iterations), "--run", out]
            done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp)
            if done.returncode != 0:
                raise SystemExit(f"{name}:\n{(done.stdout + done.stderr)[-3000:]}")
            results[name] = json.loads(Path(out).read_text())
    print(f"{args.iterations} steps, two param groups, AdamW betas 0.9 / 0.999\n")
    print(
        "| case | largest lr difference | largest beta1 difference | beta2: DeepSpeed | zerolap |"
    )
    print("|---|---|---|---|---|")
    for case in CASES:
        ds, zl = results["deepspeed"][case], results["zerolap"][case]
        pairs = [
            (d, z)
            for ds_i, zl_i in zip(ds, zl, strict=True)
            for d, z in zip(ds_i, zl_i, strict=True)
        ]
        lr = max(abs(d[0] - z[0]) for d, z in pairs)
        beta1 = max(abs(d[1] - z[1]) for d, z in pairs)
        theirs, ours = sorted({d[2] for d, _ in pairs}), sorted({z[2] for _, z in pairs})
        print(
            f"| {case} | {lr:.1e} | {beta1:.1e} | {', '.join(map(str, theirs))} | "
            f"{', '.join(map(str, ours))} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
