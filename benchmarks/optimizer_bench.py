"""The optimizer step on the CPU: whole runs against cache-sized pieces (``zero.sub_groups``).

Run from the repo root: ``python benchmarks/optimizer_bench.py [--numel 21000000] [--reps 5]
[--steps 6]``; the engines alone, on 2 ranks with the ZeRO tables' 8 MB buckets:
``OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/optimizer_bench.py --engines-only
--stage 3 --bucket 2097152 --micro-batch 2``.

* AdamW alone: torch's default (non-fused) AdamW, one thread, over ``--numel`` elements held as
  one tensor and as pieces of 4M, 1M, 256K and 64K elements; median ``step()`` time of
  ``--reps`` steps after one warm-up. The non-fused optimizer runs each of its operations over
  a whole tensor before the next, so a tensor larger than the cache makes every operation a
  trip to memory.
* zerolap: the 42M GPT at ZeRO ``--stage`` (0), DeepSpeed's default bucket (500M elements, so
  its runs are whole layers and more) unless ``--bucket``, torch's AdamW passed as the client's
  optimizer. Two engines, one built with whole runs and one with zerolap's pieces
  (``STEP_PIECE_NUMEL``), train side by side, alternating step by step in the same processes;
  median whole step and ``engine.step()`` time over ``--steps`` steps after one warm-up (the
  slowest rank's under a launcher).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def adamw_step_s(sizes: list[int], reps: int) -> float:
    import torch

    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    optimizer.step()  # the moments allocated
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def engine_step_ms(
    steps: int, stage: int, bucket: int | None, micro_batch: int
) -> dict[str, tuple[float, float]]:
    import torch

    import zerolap
    import zerolap.zero.optimizer as zero_optimizer
    from zerolap.demo.gpt import GPT, PRESETS, synthetic_batch

    cfg = PRESETS["42m"]
    pieces = zero_optimizer.STEP_PIECE_NUMEL
    engines = {}
    # The optimizer reads the piece size when it is built: each engine keeps its own.
    for name, piece in (("whole runs", 1 << 62), (f"pieces of {pieces}", pieces)):
        zero_optimizer.STEP_PIECE_NUMEL = piece
        torch.manual_seed(0)
        model = GPT(cfg)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=5e-4, betas=(0.9, 0.95), weight_decay=0.01
        )
        zero = {"stage": stage}
        if bucket is not None:
            zero.update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
        config = {"train_micro_batch_size_per_gpu": micro_batch, "zero_optimization": zero}
        engines[name], *_ = zerolap.initialize(model=model, optimizer=optimizer, config=config)
    zero_optimizer.STEP_PIECE_NUMEL = pieces
    rank = torch.distributed.get_rank()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for step in range(steps + 1):
        tokens, targets = synthetic_batch(cfg, micro_batch, seed=2 * step + rank)
        for name, engine in engines.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            loss = engine(tokens, targets)
            engine.backward(loss[0] if isinstance(loss, tuple) else loss)
            stepping = time.perf_counter()
            engine.step()
            end = time.perf_counter()
            slowest = torch.tensor([end - start, end - stepping], dtype=torch.float64)
            torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
            if step:  # the first allocates the moments
                times[name].append(tuple(slowest.tolist()))
    return {
        name: tuple(1000 * statistics.median(t[i] for t in ts) for i in (0, 1))
        for name, ts in times.items()
    }


def main() -> None:
    sys.path.insert(0, str(ROOT))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=21_000_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--engines-only", action="store_true")
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--bucket", type=int, help="reduce/allgather bucket elements")
    parser.add_argument("--micro-batch", type=int, default=1)
    args = parser.parse_args()

    import torch

    import zerolap

    torch.set_num_threads(1)
    zerolap.init_distributed(verbose=False)  # a job of one without a launcher
    first = torch.distributed.get_rank() == 0
    if not args.engines_only and first:
        adamw_table(args.numel, args.reps)
    rows = engine_step_ms(args.steps, args.stage, args.bucket, args.micro_batch)
    if first:
        world = torch.distributed.get_world_size()
        bucket = "default bucket" if args.bucket is None else f"bucket {args.bucket:,}"
        print(f"\nzerolap, 42M GPT, ZeRO {args.stage}, world {world}, {bucket}, alternating\n")
        print("| runs | step ms | engine.step() ms |")
        print("|---|---|---|")
        for name, (whole, stepping) in rows.items():
            print(f"| {name} | {whole:.0f} | {stepping:.0f} |")


def adamw_table(numel: int, reps: int) -> None:
    print(f"torch AdamW (not fused), {numel:,} elements, 1 thread\n")
    print("| held as | tensors | step ms |")
    print("|---|---|---|")
    for piece in (numel, 4 << 20, 1 << 20, 1 << 18, 1 << 16):
        whole, rest = divmod(numel, piece)
        sizes = [piece] * whole + ([rest] if rest else [])
        label = "one tensor" if piece == numel else f"pieces of {piece:,}"
        print(f"| {label} | {len(sizes)} | {1000 * adamw_step_s(sizes, reps):.1f} |")


if __name__ == "__main__":
    main()
