"""A training script for ``test_two_hosts.py``, started by ``zerolap run`` on each "host"; its
``train`` also runs on the test session's 4-rank pool, as the same job on one host (with the
comms logger off there: it records, it changes no value).

Trains a few steps of the tests' GPT-like model at the given ZeRO stage, with the comms logger
on. Rank 0 writes the final whole parameters and what crossed between the hosts: the bytes sent
on each host's network interface during training (read by its first local rank from the
namespace's own counters) and the ring traffic the comms logger recorded. With ``--kill R``,
rank R dies at the third step.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import zerolap
import zerolap.comm as dist
from tests.zero.models import TiedMLP, global_batch, loss_fn
from zerolap.zero import GatheredParameters

MICRO = 2
STEPS = 4


def _sent_bytes(interface: str | None) -> int:
    if interface is None:
        return 0
    return int(Path(f"/sys/class/net/{interface}/statistics/tx_bytes").read_text())


def train(stage: int, kill: int = -1, log_comms: bool = True) -> tuple[list, list[dict]]:
    """Train on the process group already joined: the whole parameters at the end, and every
    rank's traffic (the ring's from the comms logger, when ``log_comms``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    interface = os.environ.get("GLOO_SOCKET_IFNAME") if dist.get_local_rank() == 0 else None
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 200_000,
            "stage3_param_persistence_threshold": 0,
        },
        "comms_logger": {"enabled": log_comms},
    }
    torch.manual_seed(0)
    model = TiedMLP(width=512)  # 0.5M parameters: traffic well above the small collectives'
    engine, *_ = zerolap.initialize(model=model, config=config)
    dist.barrier()
    dist.reset_log()
    before = _sent_bytes(interface)
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    for step in range(STEPS):
        if rank == kill and step == 2:
            os._exit(9)
        tokens, targets = global_batch(step, MICRO * world)
        engine.backward(loss_fn(engine(tokens[mine]), targets[mine]))
        engine.step()
    engine.wait_in_flight()  # the last step's parameter gathers count with it
    ring = [r for r in dist.COMMS_LOGGER.records if r.op.startswith("ring_")]
    mine_sent = {
        "interface_sent": _sent_bytes(interface) - before,
        "ring_message_bytes": sum(r.message_bytes for r in ring),
        "ring_sent": sum(r.wire_bytes for r in ring),
    }
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine_sent)
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        whole = [p.detach().clone() for p in params]
    engine.destroy()
    return whole, everyone


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill", type=int, default=-1)
    args = parser.parse_args()
    dist.init_distributed(verbose=False)
    whole, everyone = train(args.stage, args.kill)
    if dist.get_rank() == 0:
        torch.save(whole, Path(args.out) / "params.pt")
        (Path(args.out) / "traffic.json").write_text(json.dumps(everyone))


if __name__ == "__main__":
    main()
