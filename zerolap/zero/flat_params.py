"""Parameters moved into one contiguous buffer, each ``param.data`` a view into it."""

from __future__ import annotations

import torch

from zerolap.zero.layout import FlatLayout

__all__ = ["FlatParams"]


class FlatParams:
    def __init__(self, params: list[torch.nn.Parameter], layout: FlatLayout) -> None:
        first = params[0]
        self.layout = layout
        self.flat = torch.zeros(layout.numel, dtype=first.dtype, device=first.device)
        for slot, param in zip(layout.slots, params, strict=True):
            view = self.flat[slot.offset : slot.offset + slot.numel].view_as(param)
            view.copy_(param.detach())
            param.data = view

    def region(self, start: int, end: int) -> torch.Tensor:
        return self.flat[start:end]

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()
