"""Where gradients accumulate, and which tensor each bucket hands to its collective.

Two kinds, chosen once per ZeRO stage:

* ``FullGradients`` (stages 0 and 1): one flat buffer of every gradient, the size of the model.
  Gradients of several micro-batches accumulate in it locally and the buffer's own bucket regions
  are reduced in place at the accumulation boundary (through a cast copy when the communication
  dtype differs).
* ``ShardGradients`` (stage 2): only this rank's shard is kept. Each bucket collects its
  gradients in a short-lived buffer that is reduce-scattered every micro-batch; the owned chunk is
  added into the shard and the buffer is dropped, so memory for the other ranks' gradients lives
  only while their bucket is in flight.

Both obey one rule: the first round of a bucket in an accumulation cycle may reduce in place;
any later round (a second backward before ``step()``, a late gradient) reduces only the new
gradients in a fresh zeroed buffer and *adds* the result.
"""

from __future__ import annotations

import torch

from zerolap.zero.bucket import Bucket
from zerolap.zero.layout import FlatLayout

__all__ = ["FullGradients", "ShardGradients"]


class FullGradients:
    def __init__(
        self, layout: FlatLayout, *, dtype: torch.dtype, comm_dtype: torch.dtype, device
    ) -> None:
        self.layout = layout
        self.comm_dtype = comm_dtype
        self.flat = torch.zeros(layout.numel, dtype=dtype, device=device)

    def write(self, bucket: Bucket, slot: int, grad: torch.Tensor) -> None:
        place = self.layout.slots[slot]
        if bucket.delivered:
            if bucket.buffer is None:
                bucket.buffer = torch.zeros(
                    bucket.layout.numel, dtype=self.comm_dtype, device=self.flat.device
                )
            start = place.offset - bucket.layout.start
            bucket.buffer[start : start + place.numel].add_(grad.reshape(-1))
        else:
            self.flat[place.offset : place.offset + place.numel].add_(grad.reshape(-1))

    def buffer_for(self, bucket: Bucket) -> torch.Tensor:
        if bucket.delivered:
            return bucket.buffer
        region = self.flat[bucket.layout.start : bucket.layout.end]
        bucket.buffer = region if region.dtype == self.comm_dtype else region.to(self.comm_dtype)
        return bucket.buffer

    def deliver(self, bucket: Bucket, reduced: torch.Tensor, start: int, end: int) -> None:
        """``reduced`` holds the reduction of flat ``[start, end)``."""
        target = self.flat[start:end]
        if bucket.delivered:
            target.add_(reduced)
        elif reduced.data_ptr() != target.data_ptr():
            target.copy_(reduced)
        bucket.delivered = True
        bucket.buffer = None

    def view(self, start: int, end: int, shard_pos: int) -> torch.Tensor:
        """Gradients of flat ``[start, end)`` (``shard_pos`` is unused: the buffer is flat)."""
        return self.flat[start:end]

    def param_grad(self, slot: int) -> torch.Tensor:
        place = self.layout.slots[slot]
        return self.flat[place.offset : place.offset + place.numel]

    def zero(self) -> None:
        self.flat.zero_()

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class ShardGradients:
    def __init__(
        self,
        layout: FlatLayout,
        rank: int,
        *,
        dtype: torch.dtype,
        comm_dtype: torch.dtype,
        device,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.comm_dtype = comm_dtype
        self.device = device
        self.shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
        self._shard_offsets = [layout.shard_offset(b.index) for b in layout.buckets]

    def write(self, bucket: Bucket, slot: int, grad: torch.Tensor) -> None:
        if bucket.buffer is None:
            bucket.buffer = torch.zeros(
                bucket.layout.numel, dtype=self.comm_dtype, device=self.device
            )
        place = self.layout.slots[slot]
        start = place.offset - bucket.layout.start
        bucket.buffer[start : start + place.numel].add_(grad.reshape(-1))

    def buffer_for(self, bucket: Bucket) -> torch.Tensor:
        if bucket.buffer is None:  # no gradient arrived this round: contribute zeros
            bucket.buffer = torch.zeros(
                bucket.layout.numel, dtype=self.comm_dtype, device=self.device
            )
        return bucket.buffer

    def deliver(self, bucket: Bucket, reduced: torch.Tensor, start: int, end: int) -> None:
        chunk_start, chunk_end = bucket.layout.chunk(self.rank)
        piece = reduced[chunk_start - start : chunk_end - start]
        offset = self._shard_offsets[bucket.index]
        self.shard[offset : offset + piece.numel()].add_(piece)
        bucket.delivered = True
        bucket.buffer = None  # the other ranks' gradients are not kept past the reduction

    def view(self, start: int, end: int, shard_pos: int) -> torch.Tensor:
        """Gradients of flat ``[start, end)``, which sit at ``shard_pos`` in the shard."""
        return self.shard[shard_pos : shard_pos + end - start]

    def param_grad(self, slot: int) -> None:
        return None  # a parameter's full gradient exists nowhere on this rank

    def zero(self) -> None:
        self.shard.zero_()

    def nbytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()
