"""DeepSpeed 0.19.8's monitors against zerolap's: the same 2-rank training writes CSV files and
TensorBoard events through each library, and the two directories are compared file by file.

Run from the repo root: ``python benchmarks/monitor_deepspeed_diff.py --deepspeed-python
/tmp/dsenv/bin/python`` (``benchmarks/deepspeed_diff.py --make-env`` makes that environment,
TensorBoard included). Each side trains a small MLP at ZeRO stage 2 for 4 steps of 2
micro-batches, with a WarmupLR schedule, ``wall_clock_breakdown`` and both ``csv_monitor`` and
``tensorboard`` on. Printed per event: whether each library wrote it, whether the CSV headers
and the sample counts agree, the largest difference of the values (for the timers, each
side's times) and the TensorBoard tags.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.deepspeed_diff import launch_ranks

STEPS, ACCUMULATION, MICRO = 4, 2, 4


def worker(library: str, out: str) -> None:
    """One rank of the run: ``deepspeed`` is whichever library ``library`` names."""
    import torch

    if library == "zerolap":
        import zerolap as deepspeed
    else:
        import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUMULATION,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "zero_optimization": {"stage": 2},
        "wall_clock_breakdown": True,
        "csv_monitor": {"enabled": True, "output_path": out, "job_name": "job"},
        "tensorboard": {"enabled": True, "output_path": out, "job_name": "job"},
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    rank = torch.distributed.get_rank()
    for step in range(STEPS):
        for micro in range(ACCUMULATION):
            generator = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            loss = engine(torch.randn(MICRO, 16, generator=generator)).pow(2).mean()
            engine.backward(loss)
            engine.step()


def _read(job: Path) -> dict:
    """Every CSV file's header and rows, and the TensorBoard tags with their steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = {}
    for path in sorted(job.glob("*.csv")):
        with path.open(newline="") as file:
            header, *rows = list(csv.reader(file))
        files[path.name] = {"header": header, "rows": [[int(s), float(v)] for s, v in rows]}
    events = EventAccumulator(str(job))
    events.Reload()
    tags = {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    return {"files": files, "tags": tags}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed-python", required=True)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # library, output path
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for library, python in (("deepspeed", args.deepspeed_python), ("zerolap", sys.executable)):
            out = Path(tmp) / library
            launch_ranks(
                python,
                Path(__file__).resolve(),
                ["--deepspeed-python", python, "--worker", library, str(out)],
                cwd=tmp,
                label=library,
            )
            results[library] = _read(out / "job")
    print(f"2 ranks, ZeRO-2, {STEPS} steps of {ACCUMULATION} micro-batches of {MICRO}, WarmupLR\n")
    print(
        "| CSV file | DeepSpeed | zerolap | same header | same steps | largest value "
        "difference (times: DeepSpeed's / zerolap's, ms) |"
    )
    print("|---|---|---|---|---|---|")
    ds_files, zl_files = results["deepspeed"]["files"], results["zerolap"]["files"]
    for name in sorted(set(ds_files) | set(zl_files)):
        ds, zl = ds_files.get(name), zl_files.get(name)
        row = [name, "yes" if ds else "no", "yes" if zl else "no"]
        if ds and zl:
            steps_equal = [s for s, _ in ds["rows"]] == [s for s, _ in zl["rows"]]
            row += [str(ds["header"] == zl["header"]), str(steps_equal)]
            if "elapsed_time" in name:  # times: each side's, in ms
                row.append(
                    " / ".join(", ".join(f"{v:.1f}" for _, v in side["rows"]) for side in (ds, zl))
                )
            else:
                gap = max(abs(d[1] - z[1]) for d, z in zip(ds["rows"], zl["rows"], strict=True))
                row.append(f"{gap:.1e}")
        else:
            row += ["-", "-", "-"]
        print("| " + " | ".join(row) + " |")
    ds_tags, zl_tags = results["deepspeed"]["tags"], results["zerolap"]["tags"]
    print(
        "\nTensorBoard tags with the same steps in both:",
        sum(ds_tags[tag] == zl_tags.get(tag) for tag in ds_tags),
        "of DeepSpeed's",
        len(ds_tags),
        "; zerolap's only:",
        sorted(set(zl_tags) - set(ds_tags)),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
