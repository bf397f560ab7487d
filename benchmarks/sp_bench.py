"""Ulysses sequence parallelism on 2 ranks against data parallelism over the same sequences.

Run from the repo root: ``python benchmarks/sp_bench.py [--quick] [--rounds 3] [--steps 4]
[--stage 2] [--seq-len 4096] [--layers 4] [--hidden 256] [--heads 8]``.

A Hugging Face Llama (sdpa attention) trained with AdamW at ZeRO ``--stage`` on 2 gloo ranks
(one thread each); every step covers the same two sequences of ``--seq-len`` tokens, one drawn
by each rank:

* ``dp``: each rank runs its own sequence whole (plain data parallelism);
* ``sp``: both ranks run both sequences in turn (2 accumulated micro-batches), each cut in
  two, half the tokens on each rank (``UlyssesSPDataLoaderAdapter``); attention trades pieces
  for heads by all-to-all (``UlyssesSPAttentionHF``), and the loss is the Trainer's
  (``deepspeed_sp_compute_loss``: the pieces' losses all-gathered, weighted by tokens).

Both compute the same gradients, so their losses agree (to rounding). Each system runs in
fresh processes, alternating in rounds; the step is the slowest rank's, the median over all
rounds. Reported per system: step time; the peak resident memory a step adds on a rank above
the engine at rest (activations, for the most part); and for ``sp`` the all-to-all bytes per
step from the comms logger against the formula (per micro-batch and layer, query, key, value
and output each way: 2 x (2 H + 2 K) x L/S x head_dim x 4 bytes, half on the wire), their time
from launch to completion and how much of it the rank sat waiting.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.zero_bench import ENV, in_rounds, median_step, parse_in_rounds

SYSTEMS = ("dp", "sp")


def _model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, intermediate_size=2 * args.hidden, vocab_size=args.vocab,
        max_position_embeddings=args.seq_len, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _sp_loss(engine, batch: dict):
    """The Trainer's loss under sequence parallelism (transformers' deepspeed_sp_compute_loss)."""
    import torch
    from torch.distributed.nn.functional import all_gather

    loss = engine(**batch, labels=batch["shift_labels"]).loss
    tokens = (batch["shift_labels"] != -100).sum()
    losses, counts = torch.stack(all_gather(loss)), torch.stack(all_gather(tokens))
    return (losses * counts).sum() / counts.sum()


def _run(rank: int, system: str, args, port: int) -> dict:
    import time
    import warnings

    import torch

    import zerolap
    import zerolap.comm as dist
    from zerolap.comm.logger import COMMS_LOGGER
    from zerolap.profiling.overlap import exposure
    from zerolap.sequence_parallel import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    warnings.filterwarnings("ignore", "torch.distributed.nn.functional.all_gather is deprecated")
    dist.init_distributed(
        dist_backend="gloo", rank=rank, world_size=2,
        init_method=f"tcp://127.0.0.1:{port}", verbose=False,
    )  # fmt: skip
    model = _model(args)
    sp = system == "sp"
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1) if sp else None
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2 if sp else 1,
        "zero_optimization": {"stage": args.stage},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "comms_logger": {"enabled": True, "prof_all": True},
    }
    engine, *_ = zerolap.initialize(model=model, config=config, mpu=mpu)
    seq = args.seq_len

    def batch(index: int) -> dict:
        g = torch.Generator().manual_seed(100 * index + rank)
        ids = torch.randint(0, args.vocab, (1, seq), generator=g)
        return {"input_ids": ids, "labels": ids, "position_ids": torch.arange(seq)[None]}

    total = args.warmup + args.steps
    loader = [batch(i) for i in range(total)]
    if sp:
        loader = UlyssesSPDataLoaderAdapter(
            loader, rank, mpu.get_sequence_parallel_group(), 2, "cpu"
        )
    loader = iter(loader)
    times, losses = [], []
    resting = peak = 0
    for index in range(total):
        if index == args.warmup:
            COMMS_LOGGER.reset()
            resting = _rss()
        torch.distributed.barrier()
        start = time.perf_counter()
        step_losses = []
        for _ in range(2 if sp else 1):
            micro = next(loader)
            loss = _sp_loss(engine, micro) if sp else engine(**micro).loss
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        times.append(time.perf_counter() - start)
        losses.append(sum(step_losses) / len(step_losses))
    peak = _peak_rss()
    a2a = [r for r in COMMS_LOGGER.records if r.op == "all_to_all_single"]
    kinds = exposure(a2a, ("all_to_all_single",)) if a2a else {}
    head_dim = args.hidden // args.heads
    formula = 2 * 2 * args.layers * (2 * args.heads + 2 * args.heads) * (seq // 2) * head_dim
    return {
        "times": times[args.warmup :],
        "losses": losses,
        "added_peak": peak - resting,
        "a2a_wire": sum(r.wire_bytes for r in a2a) / args.steps,
        "a2a_wire_formula": formula * 4 / 2 if sp else 0,
        "a2a": {k: v.as_dict() for k, v in kinds.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parse_in_rounds(parser)
    os.environ.update(ENV)
    runs = in_rounds(SYSTEMS, _run, args)
    print(
        f"Llama of {args.layers} layers (hidden {args.hidden}, {args.heads} heads, sdpa), ZeRO "
        f"{args.stage}, 2 ranks on gloo, 2 sequences of {args.seq_len} tokens per step, "
        f"{args.rounds} rounds x {args.steps} steps"
    )
    print(
        "| system | step ms | vs dp | peak MiB a step adds (rank 0) | all-to-all MiB/step "
        "(formula) | all-to-all ms/step | waited ms/step |"
    )
    print("|---|---|---|---|---|---|---|")
    step_s = {system: median_step(rounds, args.steps) for system, rounds in runs.items()}
    for system, rounds in runs.items():
        rank0 = rounds[0][0]
        a2a = rank0["a2a"].get("all_to_all_single")
        added = statistics.median(ranks[0]["added_peak"] for ranks in rounds)
        row = [
            system,
            f"{step_s[system] * 1e3:.0f}",
            f"{step_s[system] / step_s['dp']:.2f}x",
            f"{added / 2**20:.0f}",
            f"{rank0['a2a_wire'] / 2**20:.2f} ({rank0['a2a_wire_formula'] / 2**20:.2f})"
            if a2a
            else "-",
            f"{a2a['comm_s'] * 1e3 / args.steps:.1f}" if a2a else "-",
            f"{a2a['exposed_s'] * 1e3 / args.steps:.1f}" if a2a else "-",
        ]
        print("| " + " | ".join(row) + " |")
    # dp: each rank's loss is its own sequence's; sp: both ranks report the mean of both.
    dp, sp = runs["dp"][0], runs["sp"][0]
    means = [(a + b) / 2 for a, b in zip(dp[0]["losses"], dp[1]["losses"], strict=True)]
    gap = max(abs(a - b) for a, b in zip(means, sp[0]["losses"], strict=True))
    print(f"largest difference between the two systems' step losses: {gap:.2e}")


if __name__ == "__main__":
    main()
