"""A tour of ``zerolap.comm`` on a few local processes: the collectives with the seed notes'
examples, the ring all-reduce and its traffic, and the comms summary.

This is the main job until the training engine lands; ``zerolap demo`` runs it.
"""

from __future__ import annotations

import torch

import zerolap.comm as dist

__all__ = ["comm_tour"]


def _show(label: str, value) -> None:
    rank = dist.get_rank()
    text = value.tolist() if isinstance(value, torch.Tensor) else value
    for r in range(dist.get_world_size()):
        if r == rank:
            print(f"  rank {rank} {label}: {text}", flush=True)
        dist.barrier()


def _title(text: str) -> None:
    if dist.get_rank() == 0:
        print(f"\n== {text}", flush=True)
    dist.barrier()


def comm_tour() -> None:
    torch.set_num_threads(1)
    dist.init_distributed(verbose=True)
    dist.configure(enabled=True)
    rank, n = dist.get_rank(), dist.get_world_size()

    _title("all_reduce(sum): rank r holds arange(5) + r")
    t = torch.arange(5, dtype=torch.float32) + rank
    dist.all_reduce(t)
    _show("after", t)

    _title("all_gather: rank r holds full(5, r)")
    _show("gathered", [g.tolist() for g in dist.all_gather(torch.full((5,), float(rank)))])

    _title("reduce to rank 0: rank r holds r + 1; the others keep theirs")
    t = torch.full((5,), float(rank + 1))
    dist.reduce(t, dst=0)
    _show("after", t)

    _title("reduce_scatter: input of 4N filled with r + 1, output of 4")
    out = torch.zeros(4)
    dist.reduce_scatter(out, torch.full((4 * n,), float(rank + 1)))
    _show("output", out)

    _title("ring all-reduce (reduce-scatter + all-gather on isend/irecv), K = 1M floats")
    big = torch.full((1 << 20,), float(rank))
    dist.ring_all_reduce(big)
    record = dist.COMMS_LOGGER.records[-1]
    ideal = 2 * big.numel() * 4 * (n - 1) // n
    _show("sent bytes vs 2K(N-1)/N", f"{record.wire_bytes} vs {ideal}")

    _title("async all_reduce overlapping a matmul")
    handle = dist.all_reduce(torch.ones(1 << 22), async_op=True)
    x = torch.randn(512, 512)
    for _ in range(10):
        x = torch.tanh(x @ x.T / 512)
    handle.wait()
    _show("async op done", handle.is_completed())

    _title("comms summary (rank 0)")
    dist.log_summary(show_straggler=True)
    dist.destroy_process_group()
