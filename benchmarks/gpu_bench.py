"""One accelerator, world size 1: zerolap's overhead over plain PyTorch at every ZeRO stage, and
what offload to host memory costs and saves (issue 14's and issue 11's GPU figures).

Run from the repo root: ``python benchmarks/gpu_bench.py [--model gpt2|42m|small] [--batch 8]
[--gas 1] [--steps 20] [--warmup 5] [--rounds 2] [--systems NAME...] [--budget-s S]``; on a
lent GPU, ``benchmarks/gpu_check.sh`` runs it after the CUDA tests.

Every row trains the same GPT (``zerolap/demo/gpt.py``; ``gpt2`` is GPT-2 small's shape: 12
layers, d_model 768, 12 heads, 1024 tokens, vocabulary 50,304, 124M parameters) from the same
seed on the same batches, in bf16 with fp32 master weights and torch's fused AdamW (lr 1e-4,
weight decay 0.01), each in a fresh process, the rows alternating order round by round:

* ``plain``: PyTorch alone, the same arithmetic as zerolap's bf16 step: bf16 parameters, fp32
  master copies stepped by fused AdamW on fp32 copies of the gradients, the bf16 parameters
  refreshed from them. With ``--gas`` above 1 it accumulates the micro-batches' gradients in
  bf16 (``.grad``, as zerolap's stages 0-1 do); stages 2-3 accumulate their shard in fp32, so
  their losses drift from plain's by that rounding.
* ``z0`` .. ``z3``: zerolap at that stage; ``z2-cpu``: stage 2 with ``offload_optimizer: cpu``;
  ``z3-cpu``: stage 3 with ``offload_optimizer`` and ``offload_param`` on ``cpu``.
* ``ds0`` .. ``ds3``, ``ds2-cpu``, ``ds3-cpu``: DeepSpeed with the same ds_config, where
  ``import deepspeed`` reaches DeepSpeed itself (not zerolap's shim); a row DeepSpeed cannot
  run (its CPU Adam must compile) prints its error instead.

Per row: the median step time (forward, backward, step; the device synchronized around each),
against plain's; the accelerator's peak allocated memory; the process's peak RSS (where the
offloaded state went); and the largest difference of the losses from plain's over the steps.
Targets (issue 14): stages 0-2 at most 1.03x plain, stage 3 at most 1.10x.

Without an accelerator it runs on CPU (gloo) and says so: a check that the script works, whose
figures say nothing about GPUs (offload to host memory then moves nothing).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.zero_bench import TIMEOUT_S, spawn

MIB = 1 << 20
LR, WEIGHT_DECAY = 1e-4, 0.01
MODELS = {  # name -> GPTConfig keywords
    "gpt2": dict(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "42m": dict(vocab_size=8192, seq_len=256, n_layer=12, n_head=8, d_model=512),
    "small": dict(vocab_size=4096, seq_len=128, n_layer=5, n_head=4, d_model=256),
}
SYSTEMS = {  # name -> (framework, stage, offload)
    "plain": ("torch", 0, False),
    **{f"z{s}": ("zerolap", s, False) for s in range(4)},
    "z2-cpu": ("zerolap", 2, True),
    "z3-cpu": ("zerolap", 3, True),
    **{f"ds{s}": ("deepspeed", s, False) for s in range(4)},
    "ds2-cpu": ("deepspeed", 2, True),
    "ds3-cpu": ("deepspeed", 3, True),
}
TARGET = {0: 1.03, 1: 1.03, 2: 1.03, 3: 1.10}  # step time over plain's


@dataclass
class Row:
    step_s: list[float]
    losses: list[float]
    peak_device_bytes: int
    peak_rss_bytes: int
    device: str
    syncs_per_step: float | None = None  # --count-syncs: implicit host syncs, measured steps


def _config(stage: int, offload: bool, batch: int, gas: int) -> dict:
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,  # plain does not clip (DeepSpeed 0.19.8 defaults to 1.0)
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": zero,
    }


class _Plain:
    """PyTorch alone, with the fp32 master weights a bf16 run needs."""

    def __init__(self, model, torch) -> None:
        self.torch = torch
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.optimizer = torch.optim.AdamW(
            self.master, lr=LR, weight_decay=WEIGHT_DECAY, fused=True
        )

    def train_step(self, micro_batches) -> float:
        losses = []
        for tokens, targets in micro_batches:
            loss = self.model(tokens, targets)
            (loss / len(micro_batches)).backward()  # the engines' scaling by 1 / gas
            losses.append(loss.detach())
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = p.grad.float()
            p.grad = None
        self.optimizer.step()
        with self.torch.no_grad():
            self.torch._foreach_copy_(self.params, self.master)
        return sum(loss.item() for loss in losses) / len(losses)  # read once the step is queued


class _Engine:
    def __init__(self, engine) -> None:
        self.engine = engine

    def train_step(self, micro_batches) -> float:
        losses = []
        for tokens, targets in micro_batches:
            loss = self.engine(tokens, targets)
            self.engine.backward(loss)
            self.engine.step()  # steps at the last micro-batch
            losses.append(loss.detach())
        return sum(loss.item() for loss in losses) / len(losses)


def _row(
    rank: int,
    system: str,
    model_name: str,
    batch: int,
    gas: int,
    steps: int,
    warmup: int,
    count_syncs: bool,
    port,
    results,
):
    import os

    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    try:
        row = _measure(system, model_name, batch, gas, steps, warmup, count_syncs)
        results.put((rank, True, row))
    except BaseException:
        import traceback

        results.put((rank, False, traceback.format_exc()))


def _measure(
    system: str, model_name: str, batch: int, gas: int, steps: int, warmup: int, count_syncs: bool
) -> Row:
    import torch

    from zerolap.demo.gpt import GPT, GPTConfig, synthetic_batch

    framework, stage, offload = SYSTEMS[system]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = GPTConfig(**MODELS[model_name])
    torch.manual_seed(0)
    model = GPT(cfg).to(device=device, dtype=torch.bfloat16)
    if framework == "torch":
        trainer = _Plain(model, torch)
    else:
        if framework == "deepspeed":
            import deepspeed

            if "+zerolap" in deepspeed.__version__:
                raise RuntimeError("import deepspeed reaches zerolap's shim, not DeepSpeed")
        else:
            import zerolap as deepspeed
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config=_config(stage, offload, batch, gas),
        )
        trainer = _Engine(engine)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    step_s, losses = [], []
    counting = count_syncs and cuda
    with warnings.catch_warnings(record=counting) as caught:
        for step in range(warmup + steps):
            micro_batches = [
                tuple(t.to(device) for t in synthetic_batch(cfg, batch, seed=step * gas + m))
                for m in range(gas)
            ]
            sync()
            if counting and step == warmup:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")  # each implicit sync warns
                caught.clear()
            start = time.perf_counter()
            losses.append(trainer.train_step(micro_batches))
            sync()
            if step >= warmup:
                step_s.append(time.perf_counter() - start)
        if counting:
            torch.cuda.set_sync_debug_mode("default")
            found = sum("synchroniz" in str(w.message) for w in caught)
    return Row(
        step_s=step_s,
        losses=losses,
        peak_device_bytes=torch.cuda.max_memory_allocated(device) if cuda else 0,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        device=torch.cuda.get_device_name(device) if cuda else "cpu (no accelerator)",
        syncs_per_step=found / steps if counting else None,
    )


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", choices=list(MODELS))
    parser.add_argument("--batch", type=int, default=8, help="micro-batch size")
    parser.add_argument("--gas", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    default = [s for s in SYSTEMS if not s.startswith("ds")]
    parser.add_argument("--systems", nargs="+", default=default, choices=list(SYSTEMS))
    parser.add_argument(
        "--count-syncs",
        action="store_true",
        help="count the implicit host syncs of each measured step (CUDA's sync debug mode, "
        "which slows the step: a diagnosis, not a timing)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no row after this many seconds (a lent GPU's time is short); the table "
        "then holds the rows measured so far",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    systems = args.systems if "plain" in args.systems else ["plain", *args.systems]
    runs: dict[str, list[Row]] = {name: [] for name in systems}
    errors: dict[str, str] = {}
    began = time.monotonic()
    for rnd in range(args.rounds):
        order = systems if rnd % 2 == 0 else list(reversed(systems))
        for name in order:
            if name in errors:
                continue
            timeout = TIMEOUT_S
            if args.budget_s is not None:
                left = args.budget_s - (time.monotonic() - began)
                if left <= 0:
                    break
                timeout = min(timeout, left + 60)  # a row started now may finish a minute late
            try:
                job = (
                    name, args.model, args.batch, args.gas, args.steps, args.warmup,
                    args.count_syncs,
                )  # fmt: skip
                row = spawn(1, _row, job, timeout)[0]
                runs[name].append(row)
            except RuntimeError as err:
                errors[name] = str(err).strip().splitlines()[-1]
                print(f"round {rnd + 1}, {name}: failed: {errors[name]}", flush=True)
                continue
            # Each row as it ends: what a call cut short by its limit still brings back.
            print(
                f"round {rnd + 1}, {name}: {statistics.median(row.step_s) * 1e3:.1f} ms, peak "
                f"{row.peak_device_bytes / MIB:.0f} MiB on {row.device}",
                flush=True,
            )
    plain = runs["plain"]
    if not plain:
        print(f"plain PyTorch: {errors.get('plain', 'not run: --budget-s spent')}")
        return 1
    base = statistics.median(s for row in plain for s in row.step_s)
    print(
        f"{args.model}, micro-batch {args.batch} x {args.gas}, bf16, world 1 on "
        f"{plain[0].device}; median of "
        f"{args.steps} steps x up to {args.rounds} rounds after {args.warmup} warm-up steps"
    )
    syncs = f" {'syncs/step':>10}" if args.count_syncs else ""
    print(f"{'system':8} {'step':>9} {'vs plain':>9} {'target':>7} {'peak device':>12} "
          f"{'peak RSS':>9} {'loss diff':>10}{syncs}")  # fmt: skip
    for name in systems:
        if name in errors:
            print(f"{name:8} failed: {errors[name]}")
            continue
        rows = runs[name]
        if not rows:
            print(f"{name:8} not run: --budget-s {args.budget_s:.0f} spent")
            continue
        step = statistics.median(s for row in rows for s in row.step_s)
        framework, stage, offload = SYSTEMS[name]
        target = f"{TARGET[stage]:.2f}x" if framework == "zerolap" and not offload else ""
        diff = max(
            abs(a - b) for row in rows for a, b in zip(row.losses, plain[0].losses, strict=True)
        )
        counted = [r.syncs_per_step for r in rows if r.syncs_per_step is not None]
        syncs = f" {statistics.median(counted):10.1f}" if counted else ""
        print(
            f"{name:8} {step * 1e3:7.1f}ms {step / base:8.3f}x {target:>7} "
            f"{max(r.peak_device_bytes for r in rows) / MIB:9.0f}MiB "
            f"{max(r.peak_rss_bytes for r in rows) / MIB:6.0f}MiB {diff:10.2e}{syncs}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
