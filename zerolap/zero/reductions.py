"""The collective that reduces one bucket, chosen once per engine.

* ``AllReduceBuckets``: every rank receives the whole bucket's reduction (stage 0, and stages
  1-2 with ``reduce_scatter: false``, which keep only their chunk of it).
* ``ReduceScatterBuckets``: each rank receives only its chunk. On gloo it runs the ring phase of
  ``zerolap.comm`` (gloo's own reduce-scatter moves as many bytes as an all-reduce); on NCCL the
  native reduce-scatter.

Both average: gradients are multiplied by a *pre* factor before the sum and the result by a
*post* factor after (``scale_factors``). The pre factor is applied by the gradient storage as
it writes each gradient into its bucket (the copy it makes anyway), so it costs no pass of its
own; a reduction only applies the post factor, and skips it when it is 1.

Each bucket is reduced over the group its chunks are spread over (``groups[bucket]``): the
data-parallel group, or for an expert bucket its expert-data-parallel group. The factors are the
same for both (1 / the data-parallel size): an expert's gradient on one rank already sums what
the tokens of its whole expert-parallel group contributed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import zerolap.comm as dist
from zerolap.zero.bucket import Bucket

__all__ = ["AllReduceBuckets", "ReduceScatterBuckets", "scale_factors"]

# What a launched reduction returns: the handle, and a function that (after wait) scales the
# result and returns (reduced tensor, flat start, flat end).
Launched = tuple[object, Callable[[], tuple[torch.Tensor, int, int]]]


def scale_factors(
    world_size: int,
    *,
    predivide: float,
    prescale: bool,
    grad_dtype: torch.dtype,
    comm_dtype: torch.dtype,
) -> tuple[float, float]:
    """(pre, post) multipliers whose product is 1 / world_size.

    ``prescale_gradients`` divides everything before the sum, ``gradient_predivide_factor`` f
    divides by f before and by world_size / f after (DeepSpeed's split, which keeps 16-bit sums
    from overflowing without letting small gradients underflow). When gradients and their
    communication are both fp32, neither risk exists and the default (f = 1) divides before the
    sum, as DDP does: the division rides on the storage's copy, and no pass over the reduced
    bucket remains. 16-bit gradients keep it after the sum: each one divided as it is stored
    would be rounded (or, in fp16, underflow) before it is added."""
    if prescale:
        return 1.0 / world_size, 1.0
    if predivide == 1.0 and grad_dtype == comm_dtype == torch.float32:
        return 1.0 / world_size, 1.0
    return 1.0 / predivide, predivide / world_size


def _scale(tensor: torch.Tensor, factor: float) -> None:
    if factor != 1.0:
        tensor.mul_(factor)


class AllReduceBuckets:
    def __init__(self, groups: list, *, post: float) -> None:
        self.groups, self.post = groups, post

    def launch(self, bucket: Bucket, buffer: torch.Tensor) -> Launched:
        group = self.groups[bucket.layout.index]
        handle = dist.all_reduce(buffer, group=group, async_op=True)

        def result():
            _scale(buffer, self.post)
            return buffer, bucket.layout.start, bucket.layout.end

        return handle, result


class ReduceScatterBuckets:
    def __init__(self, groups: list, rank: int, *, post: float, native: bool) -> None:
        self.groups, self.rank, self.post = groups, rank, post
        self.native = native  # NCCL's reduce-scatter is bandwidth-optimal; gloo's is not

    def launch(self, bucket: Bucket, buffer: torch.Tensor) -> Launched:
        start, end = bucket.layout.chunk(self.rank)
        offset = start - bucket.layout.start
        group = self.groups[bucket.layout.index]
        if self.native:
            out = torch.empty(end - start, dtype=buffer.dtype, device=buffer.device)
            handle = dist.reduce_scatter_tensor(out, buffer, group=group, async_op=True)
        else:
            # The ring leaves chunk r of the bucket holding group rank r's reduction.
            out = buffer[offset : offset + end - start]
            handle = dist.ring_reduce_scatter(buffer, group=group, async_op=True)

        def result():
            _scale(out, self.post)
            return out, start, end

        return handle, result
