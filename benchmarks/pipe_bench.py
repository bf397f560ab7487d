"""Pipeline parallelism, p = 2 on the 42M GPT (or its shape with ``--blocks`` / ``--vocab``)
split by blocks: the measured bubble against the theory, the exposed point-to-point time, peak
activation memory per stage, and step time against DeepSpeed's PipelineEngine on the same
partition, data and optimizer; 1F1B, zerolap's
interleaved 1F1B (``--virtual-stages 1 2``: each rank holding 2 chunks of blocks) and zerolap's
ZB-H1 (``--zero-bubble``, on by default: linear layers' weight gradients deferred).

    python benchmarks/pipe_bench.py                              # zerolap only
    python benchmarks/pipe_bench.py --deepspeed-python /tmp/dsenv/bin/python
    python benchmarks/pipe_bench.py --blocks 13 --vocab 6144     # stages equal in compute

(``python benchmarks/deepspeed_diff.py --make-env /tmp/dsenv`` makes that environment once.)
Runs alternate between the systems, micro-batch counts and rounds; figures are medians.

What is measured, per train_batch:

* **bubble** (``engine.pipeline_report()``): each stage's idle share of the batch, from the
  first stage's start to the last one's end (compute = its forward and backward passes),
  against (p - 1) / (m + p - 1) (equal stages) and against the same 1F1B schedule simulated
  with this run's own per-stage forward and backward times (what the bubble is with these
  stages and free messages).
* **exposed p2p**: for every message, the time its receiver sat waiting after the sender had
  issued it (both clocks are this host's monotonic clock), summed, against the p2p time: the
  same messages' one-way time measured alone, by ping-pong, in the same run.
* **activations**: the peak of bytes saved for backward (``saved_tensors_hooks``, parameters
  excluded, each storage once) during train_batch, per stage; under ZB-H1 the inputs and output
  gradients that the deferred weight steps keep are counted with them (each storage once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# -- the worker (one per rank, under torch.distributed.run) ---------------------------------------


class SavedBytes:
    """Bytes saved for backward and alive, each storage once; ``peak`` the most at once."""

    def __init__(self, params) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.alive: dict[int, list] = {}  # storage -> [nbytes, references]
        self.now = self.peak = 0

    def pack(self, tensor):
        key = tensor.untyped_storage().data_ptr()
        if key in self.params or key == 0:
            return tensor
        entry = self.alive.setdefault(key, [tensor.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        return _Held(self, key, tensor)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: int) -> None:
        entry = self.alive[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.alive[key]


class _Held:
    """A saved tensor; its graph node dropping it is when the activation is freed."""

    def __init__(self, counter: SavedBytes, key: int, tensor) -> None:
        self.counter, self.key, self.tensor = counter, key, tensor

    def __del__(self) -> None:
        self.counter.release(self.key)


def worker(
    system: str,
    micro_batches: int,
    chunks: int,
    kind: str,
    steps: int,
    warmup: int,
    blocks: int,
    vocab: int,
    out: str,
) -> None:
    import dataclasses

    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    from zerolap.demo.gpt import GPT, PRESETS, pipeline_layers, pipeline_loss, synthetic_batch

    if system == "deepspeed":
        import deepspeed as framework
        from deepspeed.pipe import PipelineModule, TiedLayerSpec

        framework.init_distributed(dist_backend="gloo")
    else:
        import zerolap as framework
        from zerolap.pipe import PipelineModule, TiedLayerSpec

        framework.init_distributed()
    cfg = dataclasses.replace(PRESETS["42m"], n_layer=blocks, vocab_size=vocab)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    extra = {"virtual_stages": chunks} if chunks > 1 else {}  # zerolap's interleaved 1F1B
    module = PipelineModule(
        pipeline_layers(gpt, TiedLayerSpec),
        num_stages=2,
        loss_fn=pipeline_loss,
        partition_method="type:Block",
        **extra,
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": micro_batches,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
        "zero_allow_untested_optimizer": True,
    }
    if kind != "1f1b":
        config["pipeline"] = {"schedule": kind}  # zerolap's key
    optimizer = torch.optim.AdamW(
        [p for p in module.parameters() if p.requires_grad],
        lr=5e-4,
        betas=(0.9, 0.95),
        weight_decay=0.01,
    )
    engine, *_ = framework.initialize(model=module, optimizer=optimizer, config=config)
    rank = torch.distributed.get_rank()
    counter = SavedBytes(module.parameters())
    deferred = getattr(engine, "_deferred", None)  # zerolap's ZB-H1
    if deferred is not None:
        _count_deferred(deferred, counter)
    times, stats, reports, losses = [], [], [], []
    for step in range(warmup + steps):
        tokens, targets = synthetic_batch(cfg, micro_batches, seed=step)
        data = iter([(tokens[i : i + 1], targets[i : i + 1]) for i in range(micro_batches)])
        torch.distributed.barrier()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            loss = engine.train_batch(data_iter=data)
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed)
            losses.append(float(loss))
            if system == "zerolap":
                stats.append(engine.last_stats)
                reports.append(engine.pipeline_report())
    ping = _ping(stats[-1]["p2p"], rank) if system == "zerolap" else {}
    mine = {
        "times": times,
        "losses": losses,
        "stats": stats,
        "reports": reports,
        "ping": ping,
        "peak": counter.peak,
    }
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))


def _count_deferred(deferred, counter: SavedBytes) -> None:
    """What ZB-H1's deferred weight steps keep (``DeferredWeights.observer``) counted with the
    saved tensors, each storage once."""
    held: dict[int, list] = {}

    def observe(tensor, kept: bool) -> None:
        if kept:
            held.setdefault(id(tensor), []).append(counter.pack(tensor))
        else:
            held[id(tensor)].pop()  # its _Held goes: released when nothing else holds it

    deferred.observer = observe


def _ping(events: list, rank: int) -> dict[str, float]:
    """One-way time of each message size this pipeline sends, alone: median of 10 ping-pongs
    between the two stages (rank 0 -> 1 and back), halved."""
    import torch

    sizes = sorted({e[5] for e in events if e[0] == "wait"})
    agreed = [sizes]
    torch.distributed.broadcast_object_list(agreed, src=1)  # stage 1 receives activations
    sizes = sorted(set(sizes) | set(agreed[0]))
    out = {}
    for nbytes in sizes:
        buffer = torch.empty(nbytes // 4, dtype=torch.float32)
        trips = []
        for _ in range(10):
            torch.distributed.barrier()
            start = time.perf_counter()
            if rank == 0:
                torch.distributed.send(buffer, 1)
                torch.distributed.recv(buffer, 1)
            else:
                torch.distributed.recv(buffer, 0)
                torch.distributed.send(buffer, 0)
            trips.append(time.perf_counter() - start)
        out[str(nbytes)] = statistics.median(trips) / 2
    return out


# -- the analysis ---------------------------------------------------------------------------------


def analyse(ranks: list[dict]) -> dict:
    """Medians over the measured steps: the engine's own pipeline report, and its exposed p2p
    time against the same messages' one-way time measured alone."""
    reports = ranks[0]["reports"]
    ping = ranks[0]["ping"]
    shares, p2p = [], []
    for step, report in enumerate(reports):
        total = sum(
            ping[str(nbytes)]
            for r in ranks
            for kind, direction, _, _, _, nbytes, _ in r["stats"][step]["p2p"]
            if kind == "wait" and direction != "METADATA"
        )
        p2p.append(total)
        shares.append(sum(report["exposed_p2p_s"]) / total if total else 0.0)
    stages = len(ranks)

    def per_stage(key):
        return [statistics.median(r[key][s] for r in reports) for s in range(stages)]

    return {
        "step_s": statistics.median(ranks[0]["times"]),
        "bubble": per_stage("bubble"),
        "bubble_formula": reports[0]["bubble_formula"],
        "bubble_simulated": per_stage("bubble_simulated"),
        "exposed_p2p_s": statistics.median(sum(r["exposed_p2p_s"]) for r in reports),
        "p2p_s": statistics.median(p2p),
        "exposed_share": statistics.median(shares),
        "peak_activation_mib": [r["peak"] / 2**20 for r in ranks],
    }


# -- the driver ---------------------------------------------------------------------------------


def launch(
    python: str, system: str, micro_batches: int, chunks: int, kind: str, args
) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [
            python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            __file__, "--worker", system, "--micro-batches", str(micro_batches),
            "--virtual-stages", str(chunks), "--schedule", kind,
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--blocks", str(args.blocks), "--vocab", str(args.vocab), "--out", str(out),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0 and not out.exists():
            raise SystemExit(f"{system} failed:\n{(done.stdout + done.stderr)[-4000:]}")
        if done.returncode != 0:  # DeepSpeed 0.19.8 on gloo now and then aborts at exit
            print(f"{system} exited with {done.returncode} after writing its results", flush=True)
        return json.loads(out.read_text())


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from zerolap.demo.gpt import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["zerolap", "deepspeed"])
    parser.add_argument("--out")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument(
        "--virtual-stages", type=int, nargs="+", default=[1, 2],
        help="chunks per rank: 1 is 1F1B, more is zerolap's interleaved 1F1B",
    )  # fmt: skip
    parser.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)  # a worker's
    parser.add_argument(
        "--zero-bubble", action=argparse.BooleanOptionalAction, default=True,
        help="also zerolap's ZB-H1 (pipeline.schedule: zb-h1)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    # The 42M GPT's last stage carries the LM head and the loss as well as its 6 blocks;
    # --blocks 13 --vocab 6144 makes the stages equal in compute (7 blocks against 6 + the head).

    shape = PRESETS["42m"]
    parser.add_argument("--blocks", type=int, default=shape.n_layer, help="transformer blocks")
    parser.add_argument("--vocab", type=int, default=shape.vocab_size, help="vocabulary size")
    parser.add_argument("--deepspeed-python")
    args = parser.parse_args()
    if args.worker:
        worker(
            args.worker,
            args.micro_batches[0],
            args.virtual_stages[0],
            args.schedule,
            args.steps,
            args.warmup,
            args.blocks,
            args.vocab,
            args.out,
        )
        return
    systems = {"zerolap": sys.executable}
    if args.deepspeed_python:
        systems["deepspeed"] = args.deepspeed_python
    results: dict = {}
    variants = [(v, "1f1b") for v in args.virtual_stages]  # (chunks, schedule)
    if args.zero_bubble:
        variants.append((1, "zb-h1"))
    runs = [
        (system, python, m, v, kind)
        for m in args.micro_batches
        for v, kind in variants
        for system, python in systems.items()
        if (v, kind) == (1, "1f1b") or system == "zerolap"  # DeepSpeed: 1F1B only
    ]
    for round_ in range(args.rounds):
        for system, python, m, v, kind in runs:
            ranks = launch(python, system, m, v, kind, args)
            results.setdefault((system, m, v, kind), []).append(ranks)
            print(
                f"round {round_ + 1}: {system} m={m} v={v} {kind} step {ranks[0]['times']}",
                flush=True,
            )
    print()
    print(
        "| m | system | step s (median) | vs zerolap 1F1B | bubble stage 0 / 1 | formula | "
        "simulated | exposed p2p / p2p time | peak activations MiB, stage 0 / 1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for m in args.micro_batches:
        base = None
        for v, kind in variants:
            ours = [analyse(r) for r in results[("zerolap", m, v, kind)]]
            step = statistics.median(a["step_s"] for a in ours)
            base = base or step
            bubble = [statistics.median(a["bubble"][s] for a in ours) for s in range(2)]
            sim = [statistics.median(a["bubble_simulated"][s] for a in ours) for s in range(2)]
            exposed = statistics.median(a["exposed_p2p_s"] for a in ours) * 1e3
            p2p = statistics.median(a["p2p_s"] for a in ours) * 1e3
            peak = ours[0]["peak_activation_mib"]
            formula = ours[0]["bubble_formula"]
            name = "zerolap ZB-H1" if kind == "zb-h1" else "zerolap 1F1B"
            name = f"zerolap interleaved, v={v}" if v > 1 else name
            print(
                f"| {m} | {name} | {step:.3f} | {step / base:.2f} | {bubble[0]:.3f} / "
                f"{bubble[1]:.3f} | {formula:.3f} | {sim[0]:.3f} / {sim[1]:.3f} | "
                f"{exposed:.1f} / {p2p:.1f} ms | {peak[0]:.0f} / {peak[1]:.0f} |"
            )
        if ("deepspeed", m, 1, "1f1b") in results:
            runs = results[("deepspeed", m, 1, "1f1b")]
            ds_step = statistics.median(statistics.median(r[0]["times"]) for r in runs)
            ds_peak = [runs[0][s]["peak"] / 2**20 for s in range(2)]
            print(
                f"| {m} | DeepSpeed 0.19.8 | {ds_step:.3f} | {ds_step / base:.2f} | - | - | - | "
                f"- | {ds_peak[0]:.0f} / {ds_peak[1]:.0f} |"
            )
    for m in args.micro_batches:
        if ("deepspeed", m, 1, "1f1b") in results:
            ours = results[("zerolap", m, 1, "1f1b")][0][0]["losses"]
            theirs = results[("deepspeed", m, 1, "1f1b")][0][0]["losses"]
            gap = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
            print(f"m={m}: largest loss difference zerolap vs DeepSpeed over the steps: {gap:.2e}")


if __name__ == "__main__":
    main()
