"""Tensor parallelism on 2 ranks: how much of its communication each overlap hides.

Run from the repo root: ``python benchmarks/tp_bench.py [--quick] [--rounds 3] [--steps 4]
[--micro-batch 8] [--d-model 128] [--layers 8]``.

A GPT (``zerolap/demo/gpt.py``, tied LM head, vocab-parallel embedding, head and loss) split
over a tensor group of 2 (gloo on localhost, one thread per rank, no data parallelism), sized
so that its all-reduces are a sizeable part of the step. One training step is forward,
backward and fp32 AdamW. Systems, each in fresh processes, alternating in rounds; step time is
the slowest rank's, the median over the measured steps of all rounds:

* ``sync``: every all-reduce waited for where it is launched;
* ``backward``: DeepSpeed's ``tp_overlap_comm`` (column-parallel input gradients under the
  weight gradients);
* ``full``: zerolap's ``overlap: full`` (each block's micro-batch in two lanes, one half's
  all-reduces under the other half's compute, forward and backward);
* ``skipped``: ``sync`` with every tensor-parallel all-reduce skipped (wrong results): the step
  if communication were free, the optimum; ``full-skipped`` likewise for ``full``, which prices
  the lanes themselves (half-size matmuls, thread hand-overs, the summed gradients);
* ``torch``: PyTorch's own tensor parallelism, ``parallelize_module`` with DTensor
  (``ColwiseParallel`` / ``RowwiseParallel``, the vocab-parallel embedding and head, and
  ``loss_parallel``), on the same model with the same weights layout (the fused QKV rows
  ordered so that each rank's contiguous slice holds its own heads).

First, a probe of the host: one half-batch all-reduce alone (wall and CPU time), a matmul of
about its length alone, and the two started together, i.e. how much of an all-reduce any
overlap can hide here. Then per zerolap system the comms logger gives each kind of all-reduce
(forward, backward): bytes, T_comm (launch to completion) and the exposed time (the rank
sitting in the launch or in ``wait()``), so eta_TP = 1 - exposed / T_comm is measured, not
assumed. Since hidden communication can still slow the compute down, each system's step also
gives ``recovered`` = (t_sync - t) / (t_sync - t_skipped), the share of the synchronous step's
communication cost won back; and every system's CPU time outside its computing threads
(gloo's, moving the bytes), which on a host without spare cores is the floor no overlap gets
under: the skipped step plus that. Targets for ``full``: eta_TP >= 0.7, step <= 0.85x
``sync`` and <= 1.10x ``skipped``, and no slower than ``torch``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.zero_bench import ENV, parse_in_rounds, spawn
from zerolap.profiling.overlap import Exposure
from zerolap.tensor_parallel.mappings import BACKWARD, FORWARD

SYSTEMS = ("sync", "backward", "full", "skipped", "full-skipped", "torch")
OVERLAP = {
    "sync": "off",
    "backward": "backward",
    "full": "full",
    "skipped": "off",
    "full-skipped": "full",
}
LR = 1e-4


def _model(args):
    import torch

    from zerolap.demo.gpt import GPT, GPTConfig

    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq_len, n_layer=args.layers,
        n_head=args.heads, d_model=args.d_model,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT(cfg), cfg


def _zerolap_step(system: str, args):
    import zerolap
    from zerolap.tensor_parallel.mappings import skipped_collectives

    model, cfg = _model(args)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 0},
        "tensor_parallel": {"autotp_size": 2, "overlap": OVERLAP[system]},
        "comms_logger": {"enabled": True, "prof_all": True},
    }
    engine, *_ = zerolap.initialize(model=model, config=config)

    def step(tokens, targets) -> float:
        with skipped_collectives() if system.endswith("skipped") else contextlib.nullcontext():
            loss = engine(tokens, targets)
            engine.backward(loss)
        engine.step()
        return loss.item()

    return step, cfg


def _torch_step(args):
    """The same GPT under ``torch.distributed.tensor.parallel``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    model, cfg = _model(args)
    mesh = init_device_mesh("cpu", (2,))
    d, heads = cfg.d_model, cfg.n_head
    # ColwiseParallel cuts rows in contiguous halves: order the fused QKV rows so that each
    # half is that rank's heads of Q, K and V (what zerolap's per-block split keeps).
    order = torch.cat(
        [torch.arange(part * d + t * d // 2, part * d + (t + 1) * d // 2)
         for t in range(2) for part in range(3)]
    )  # fmt: skip
    for block in model.blocks:
        with torch.no_grad():
            block.attn.qkv.weight.copy_(block.attn.qkv.weight[order])
            block.attn.qkv.bias.copy_(block.attn.qkv.bias[order])
        block.attn.n_head = heads // 2
        parallelize_module(
            block,
            mesh,
            {
                "attn.qkv": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.0": ColwiseParallel(),
                "mlp.2": RowwiseParallel(),
            },
        )
    parallelize_module(
        model,
        mesh,
        {
            "tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        },
    )
    model.head.weight = model.tok_emb.weight  # both Shard(0): tied again
    dtensors = [p for p in model.parameters() if type(p.data).__name__ == "DTensor"]
    plain = [p for p in model.parameters() if type(p.data).__name__ != "DTensor"]
    optimizers = [torch.optim.AdamW(group, lr=LR, weight_decay=0.01) for group in (dtensors, plain)]

    def step(tokens, targets) -> float:
        with loss_parallel():
            loss = model(tokens, targets)
            loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()

    return step, cfg


def _comm_threads_cpu_s() -> float:
    """CPU seconds this process has spent outside its computing threads (the main thread and
    the lanes): gloo's threads, moving the bytes."""
    import threading

    import psutil

    computing = {threading.main_thread().native_id}
    computing |= {t.native_id for t in threading.enumerate() if t.name.startswith("zerolap-tp")}
    return sum(
        t.user_time + t.system_time for t in psutil.Process().threads() if t.id not in computing
    )


def _run(rank: int, system: str, args, port: int) -> dict:
    import time

    import torch

    import zerolap.comm as dist
    from zerolap.comm.logger import COMMS_LOGGER
    from zerolap.demo.gpt import synthetic_batch
    from zerolap.profiling.overlap import exposure

    dist.init_distributed(
        dist_backend="gloo", rank=rank, world_size=2,
        init_method=f"tcp://127.0.0.1:{port}", verbose=False,
    )  # fmt: skip
    step, cfg = _torch_step(args) if system == "torch" else _zerolap_step(system, args)
    times, losses = [], []
    comm_cpu = 0.0
    for index in range(args.warmup + args.steps):
        if index == args.warmup:
            COMMS_LOGGER.reset()
            comm_cpu = -_comm_threads_cpu_s()
        tokens, targets = synthetic_batch(cfg, args.micro_batch, seed=index)
        torch.distributed.barrier()
        start = time.perf_counter()
        losses.append(step(tokens, targets))
        times.append(time.perf_counter() - start)
    comm_cpu += _comm_threads_cpu_s()
    kinds = exposure(COMMS_LOGGER.records, (FORWARD, BACKWARD))
    return {
        "comm_cpu_s": comm_cpu / args.steps,
        "times": times[args.warmup :],
        "losses": losses,
        "kinds": {k: v.as_dict() for k, v in kinds.items()},
    }


def _probe(rank: int, args, port: int) -> dict:
    """What overlap can buy on this host: one half-batch all-reduce alone (wall and CPU time),
    a matmul of about its length alone, and the two started together."""
    import time

    import torch

    import zerolap.comm as dist

    dist.init_distributed(
        dist_backend="gloo", rank=rank, world_size=2,
        init_method=f"tcp://127.0.0.1:{port}", verbose=False,
    )  # fmt: skip
    x = torch.randn(args.micro_batch // 2 * args.seq_len * args.d_model)
    a = torch.randn(512, 512)

    def timed(fn, n=100):
        fn()
        torch.distributed.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            fn()
        return (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n

    def together():
        handle = torch.distributed.all_reduce(x, async_op=True)
        a @ a
        handle.wait()

    ar_wall, ar_cpu = timed(lambda: torch.distributed.all_reduce(x))
    mm_wall, _ = timed(lambda: a @ a)
    both, _ = timed(together)
    return {"ar_wall": ar_wall, "ar_cpu": ar_cpu, "mm_wall": mm_wall, "both": both}


def _rank_main(rank: int, system: str, args, port: int, results) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        work = _probe(rank, args, port) if system == "probe" else _run(rank, system, args, port)
        results.put((rank, True, work))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def x_kib(args) -> int:
    return args.micro_batch // 2 * args.seq_len * args.d_model * 4 // 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    args = parse_in_rounds(parser)
    os.environ.update(ENV)
    probe = spawn(2, _rank_main, ("probe", args))[0]
    runs: dict[str, list[dict]] = {s: [] for s in args.systems}
    for round_index in range(args.rounds):
        for system in args.systems:
            ranks = spawn(2, _rank_main, (system, args))
            runs[system].append(ranks)
            print(f"round {round_index + 1}: {system} done", file=sys.stderr)
    print(
        f"GPT d_model={args.d_model} layers={args.layers} heads={args.heads} "
        f"seq={args.seq_len} vocab={args.vocab}, micro-batch {args.micro_batch}, TP 2 on gloo, "
        f"{args.rounds} rounds x {args.steps} steps, median of the slowest rank's step"
    )
    hidden = probe["ar_wall"] + probe["mm_wall"] - probe["both"]
    print(
        f"this host: one {x_kib(args)} KiB all-reduce takes {probe['ar_wall'] * 1e3:.2f} ms, "
        f"{probe['ar_cpu'] * 1e3:.2f} ms of it CPU (gloo copies through loopback TCP); started "
        f"with a {probe['mm_wall'] * 1e3:.2f} ms matmul, {hidden / probe['ar_wall']:.0%} of it "
        "is hidden"
    )
    step_s = {}
    for system, rounds in runs.items():
        per_step = [
            max(r["times"][i] for r in ranks) for ranks in rounds for i in range(args.steps)
        ]
        step_s[system] = statistics.median(per_step)
    # The systems train the same model: their first losses agree (skipped ones aside).
    first = {system: rounds[0][0]["losses"][0] for system, rounds in runs.items()}
    print("first-step loss: " + ", ".join(f"{k} {v:.5f}" for k, v in first.items()))
    print(
        "| system | step ms | vs sync | vs skipped | recovered | fwd eta | bwd eta "
        "| TP comm ms | exposed ms | gloo CPU ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    kinds = {system: _exposures(rounds, args.steps) for system, rounds in runs.items()}
    for system, rounds in runs.items():
        step = step_s[system]
        row = [system, f"{step * 1e3:.1f}"]
        row.append(f"{step / step_s['sync']:.2f}x" if "sync" in step_s else "-")
        row.append(f"{step / step_s['skipped']:.2f}x" if "skipped" in step_s else "-")
        row.append(f"{_recovered(step_s, system):.2f}" if _has_bounds(step_s) else "-")
        mine = kinds[system]
        if mine is None:
            row += ["-"] * 4
        else:
            total = _total(mine)
            row += [f"{mine[FORWARD].eta:.2f}", f"{mine[BACKWARD].eta:.2f}"]
            row += [f"{total.comm_s * 1e3:.1f}", f"{total.exposed_s * 1e3:.1f}"]
        gloo_cpu = statistics.median(r["comm_cpu_s"] for ranks in rounds for r in ranks)
        print("| " + " | ".join([*row, f"{gloo_cpu * 1e3:.1f}"]) + " |")
    some = next((k for k in kinds.values() if k is not None), None)
    if some is not None:
        print(
            f"TP all-reduce bytes per step and rank: forward "
            f"{some[FORWARD].message_bytes / 2**20:.2f} MiB, backward "
            f"{some[BACKWARD].message_bytes / 2**20:.2f} MiB"
        )
    if kinds.get("sync") is not None:
        sync_comm = _total(kinds["sync"]).comm_s
        print(f"TP communication is {sync_comm / step_s['sync']:.0%} of the sync step")
    if _has_bounds(step_s):
        # The cores that compute must also run gloo's copies: no overlap beats this here.
        gloo = statistics.median(r["comm_cpu_s"] for ranks in runs["sync"] for r in ranks)
        limit = step_s["skipped"] + gloo
        print(
            f"limit on this host: skipped step + gloo's CPU time = {limit * 1e3:.1f} ms "
            f"({limit / step_s['sync']:.2f}x sync, recovered "
            f"{(step_s['sync'] - limit) / (step_s['sync'] - step_s['skipped']):.2f})"
        )
    if kinds.get("full") is not None:
        checks = [f"eta_TP {_total(kinds['full']).eta:.2f} (>= 0.7)"]
        if "sync" in step_s:
            checks.append(f"full/sync {step_s['full'] / step_s['sync']:.2f} (<= 0.85)")
        if "skipped" in step_s:
            checks.append(f"full/skipped {step_s['full'] / step_s['skipped']:.2f} (<= 1.10)")
        if "torch" in step_s:
            checks.append(f"full/torch {step_s['full'] / step_s['torch']:.2f} (<= 1.00)")
        print("targets: " + ", ".join(checks))


def _exposures(rounds: list, steps: int) -> dict[str, Exposure] | None:
    """Per kind, one rank's step: the medians over ranks and rounds (None without TP
    all-reduces: torch, and the skipped systems)."""
    ranks = [r for each in rounds for r in each]
    if not any(r["kinds"][FORWARD]["count"] for r in ranks):
        return None
    out = {}
    for kind in (FORWARD, BACKWARD):
        out[kind] = Exposure(**{
            field: statistics.median(r["kinds"][kind][field] for r in ranks) / steps
            for field in ("count", "message_bytes", "comm_s", "exposed_s")
        })  # fmt: skip
    return out


def _total(kinds: dict[str, Exposure]) -> Exposure:
    return Exposure(
        count=sum(k.count for k in kinds.values()),
        message_bytes=sum(k.message_bytes for k in kinds.values()),
        comm_s=sum(k.comm_s for k in kinds.values()),
        exposed_s=sum(k.exposed_s for k in kinds.values()),
    )


def _has_bounds(step_s: dict[str, float]) -> bool:
    return "sync" in step_s and "skipped" in step_s


def _recovered(step_s: dict[str, float], system: str) -> float:
    """The share of the synchronous step's communication cost that ``system`` wins back:
    (t_sync - t) / (t_sync - t_skipped); 1 is the optimum, 0 no better than sync. It prices
    everything overlap does to the step, which the waits alone do not."""
    return (step_s["sync"] - step_s[system]) / (step_s["sync"] - step_s["skipped"])


if __name__ == "__main__":
    main()
