"""Mixture of experts on 2 ranks: every expert on every rank against experts spread over them.

Run from the repo root: ``python benchmarks/moe_bench.py [--quick] [--rounds 3] [--steps 4]
[--stage 2] [--experts 8] [--layers 4] [--d-model 256] [--micro-batch 8] [--seq-len 128]``.

A model of ``--layers`` residual MoE layers (``zerolap.moe.layer.MoE``, top-2, capacity factor
1.25, experts of d -> 4d -> d) between an embedding and a head, trained with AdamW at ZeRO
``--stage`` on 2 gloo ranks (one thread each), each rank with its own micro-batch:

* ``ep1``: ``ep_size=1``, every rank holds and runs all the experts on its own tokens;
* ``ep2``: ``ep_size=2``, each rank holds half of them and runs them on both ranks' tokens,
  which travel by all-to-all (one each way per layer forward, two more in backward).

Both do the same arithmetic, so their losses agree (to rounding). Each system runs in fresh
processes, alternating in rounds; the step is the slowest rank's, the median over all rounds.
Reported per system: step time, model-state bytes per rank (``memory_breakdown``) against the
formula, and for ``ep2`` the all-to-all bytes per step from the comms logger against the
formula (4 per layer of the [experts, capacity, width] buffer, half of each on the wire), their
time from launch to completion, and how much of it the rank sat waiting.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.zero_bench import ENV, in_rounds, median_step, parse_in_rounds

SYSTEMS = ("ep1", "ep2")
CAPACITY_FACTOR, MIN_CAPACITY = 1.25, 4  # top-2's buffers: 2 x 1.25 x an even share of tokens


def _model(args, ep_size: int):
    import torch
    import torch.nn.functional as F

    from zerolap.moe.layer import MoE

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            d = args.d_model
            self.embed = torch.nn.Embedding(args.vocab, d)
            expert = torch.nn.Sequential(
                torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
            )
            routing = {"k": 2, "capacity_factor": CAPACITY_FACTOR, "min_capacity": MIN_CAPACITY,
                       "top2_2nd_expert_sampling": False}  # fmt: skip
            self.moes = torch.nn.ModuleList(
                MoE(d, expert, args.experts, ep_size, **routing) for _ in range(args.layers)
            )
            self.norm = torch.nn.LayerNorm(d)
            self.head = torch.nn.Linear(d, args.vocab)

        def forward(self, tokens, targets):
            h = self.embed(tokens)
            aux = 0.0
            for moe in self.moes:
                out, l_aux, _ = moe(h)
                h, aux = h + out, aux + l_aux
            logits = self.head(self.norm(h))
            return F.cross_entropy(logits.view(-1, args.vocab), targets.view(-1)) + 0.01 * aux

    return Net()


def _run(rank: int, system: str, args, port: int) -> dict:
    import time

    import torch

    import zerolap
    import zerolap.comm as dist
    from zerolap.comm.logger import COMMS_LOGGER
    from zerolap.moe.gating import capacity
    from zerolap.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from zerolap.profiling.overlap import exposure

    dist.init_distributed(
        dist_backend="gloo", rank=rank, world_size=2,
        init_method=f"tcp://127.0.0.1:{port}", verbose=False,
    )  # fmt: skip
    ep_size = int(system[2:])
    model = _model(args, ep_size)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense"}
    )
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "zero_optimization": {"stage": args.stage},
        "gradient_clipping": 1.0,
        "comms_logger": {"enabled": True, "prof_all": True},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = zerolap.initialize(
        model=model, optimizer=torch.optim.AdamW(groups, lr=1e-3), config=config
    )
    times, losses = [], []
    for index in range(args.warmup + args.steps):
        if index == args.warmup:
            COMMS_LOGGER.reset()
        g = torch.Generator().manual_seed(100 * index + rank)
        tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len), generator=g)
        targets = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len), generator=g)
        torch.distributed.barrier()
        start = time.perf_counter()
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    a2a = [r for r in COMMS_LOGGER.records if r.op == "all_to_all_single"]
    kinds = exposure(a2a, ("all_to_all_single",)) if a2a else {}
    memory = engine.memory_breakdown()
    room = capacity(
        args.micro_batch * args.seq_len, args.experts, 2 * CAPACITY_FACTOR, MIN_CAPACITY
    )
    buffer_bytes = args.experts * room * args.d_model * 4
    return {
        "times": times[args.warmup :],
        "losses": losses,
        "state_bytes": memory.total_bytes,
        "expected_bytes": memory.expected_bytes,
        "a2a_wire": sum(r.wire_bytes for r in a2a) / args.steps,
        "a2a_wire_formula": 4 * args.layers * buffer_bytes * (ep_size - 1) / ep_size,
        "a2a": {k: v.as_dict() for k, v in kinds.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2))
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parse_in_rounds(parser)
    os.environ.update(ENV)
    runs = in_rounds(SYSTEMS, _run, args)
    print(
        f"{args.layers} MoE layers x {args.experts} experts (d={args.d_model}, top-2), ZeRO "
        f"{args.stage}, 2 ranks on gloo, micro-batch {args.micro_batch} x {args.seq_len} "
        f"tokens per rank, {args.rounds} rounds x {args.steps} steps"
    )
    first = runs["ep1"][0]
    print(
        "| system | step ms | vs ep1 | model state MiB/rank | vs formula | all-to-all MiB/step "
        "(formula) | all-to-all ms/step | waited ms/step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    step_s = {system: median_step(rounds, args.steps) for system, rounds in runs.items()}
    for system, rounds in runs.items():
        rank0 = rounds[0][0]
        a2a = rank0["a2a"].get("all_to_all_single")
        row = [
            system,
            f"{step_s[system] * 1e3:.0f}",
            f"{step_s[system] / step_s['ep1']:.2f}x",
            f"{rank0['state_bytes'] / 2**20:.1f}",
            f"{rank0['state_bytes'] / rank0['expected_bytes']:.3f}",
            f"{rank0['a2a_wire'] / 2**20:.2f} ({rank0['a2a_wire_formula'] / 2**20:.2f})",
            f"{a2a['comm_s'] * 1e3 / args.steps:.1f}" if a2a else "-",
            f"{a2a['exposed_s'] * 1e3 / args.steps:.1f}" if a2a else "-",
        ]
        print("| " + " | ".join(row) + " |")
    spread = runs["ep2"][0]
    gap = max(
        abs(a - b)
        for r in range(2)
        for a, b in zip(first[r]["losses"], spread[r]["losses"], strict=True)
    )
    steps = len(first[0]["losses"])
    print(f"largest loss difference between ep1 and ep2 over {steps} steps: {gap:.2e}")


if __name__ == "__main__":
    main()
