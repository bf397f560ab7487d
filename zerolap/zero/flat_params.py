"""Stages 0-2: parameters moved into one contiguous buffer, each ``param.data`` a view into it.

Every rank holds every parameter; after a sharded optimizer step each bucket is all-gathered
from the owners of its chunks (``publish``).
"""

from __future__ import annotations

import torch

from zerolap.zero.gather import all_gather_bucket
from zerolap.zero.layout import FlatLayout, OwnedRun

__all__ = ["FlatParams"]


class FlatParams:
    swap = None  # parameters are never swapped below stage 3

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        layout: FlatLayout,
        *,
        group,
        rank: int,
        native: bool,
        sharded: bool,
    ) -> None:
        first = params[0]
        self.layout = layout
        self.group, self.rank, self.native = group, rank, native
        self.sharded = sharded  # whether the optimizer updates only this rank's chunks
        self.params = params  # in layout slot order
        self.flat = torch.zeros(layout.numel, dtype=first.dtype, device=first.device)
        for slot, param in zip(layout.slots, params, strict=True):
            view = self.flat[slot.offset : slot.offset + slot.numel].view_as(param)
            view.copy_(param.detach())
            param.data = view

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    @property
    def device(self) -> torch.device:
        return self.flat.device

    def region(self, start: int, end: int) -> torch.Tensor:
        return self.flat[start:end]

    def owned_view(self, run: OwnedRun, shard_pos: int) -> torch.Tensor:
        """The parameter elements of ``run`` (``shard_pos`` is unused: the buffer is flat)."""
        return self.flat[run.start : run.end]

    def publish(self) -> None:
        """Every bucket all-gathered from its chunks' owners, all in flight at once."""
        if not self.sharded:
            return
        handles = [
            all_gather_bucket(
                self.flat[b.start : b.end], b, rank=self.rank, group=self.group, native=self.native
            )
            for b in self.layout.buckets
        ]
        for handle in handles:
            handle.wait()

    def detach_params(self) -> None:
        """Each parameter takes its own copy of its values and stops viewing the flat buffer
        (``engine.destroy()``), which can then be freed."""
        for slot, param in zip(self.layout.slots, self.params, strict=True):
            param.data = self.flat[slot.offset : slot.offset + slot.numel].view_as(param).clone()
        self.flat = self.flat[:0]

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def buffer_bytes(self) -> int:
        return 0  # nothing beyond the flat buffer itself

    def swap_buffer_bytes(self) -> int:
        return 0  # stages 0-2 keep parameters in memory

    def swapped_bytes(self) -> int:
        return 0
