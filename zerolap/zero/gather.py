"""All-gather of one bucket from its owners' chunks: the way updated or sharded parameters
come back whole (after a stage 1-2 step; before a stage-3 module runs).

On NCCL the native ``all_gather_into_tensor``; on gloo the ring phase of ``zerolap.comm``, which
moves K(N-1)/N bytes per rank where gloo's own all-gather is several times slower.
"""

from __future__ import annotations

import torch

import zerolap.comm as dist
from zerolap.zero.layout import BucketLayout

__all__ = ["all_gather_bucket"]


def all_gather_bucket(
    region: torch.Tensor, bucket: BucketLayout, *, rank: int, group, native: bool, prepare=None
):
    """Fill ``region`` (the whole bucket) from every rank's chunk; returns the async handle.
    This rank's chunk is in place already, or put there by ``prepare``: called here on NCCL,
    by the ring's own thread just before it runs on gloo."""
    if native:
        if prepare is not None:
            prepare()
        start, end = bucket.chunk(rank)
        mine = region[start - bucket.start : end - bucket.start]
        return dist.all_gather_into_tensor(region, mine, group=group, async_op=True)
    return dist.ring_all_gather(region, group=group, async_op=True, prepare=prepare)
