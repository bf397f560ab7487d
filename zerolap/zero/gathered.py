"""``GatheredParameters``: full parameters inside a ``with`` block.

Under stages 0-2 every rank always holds every parameter in full, so entering gathers nothing.
With ``modifier_rank`` set, that rank's changes are broadcast to the others on exit so the copies
stay identical, as they must for data parallelism.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

import zerolap.comm as dist

__all__ = ["GatheredParameters"]


class GatheredParameters:
    def __init__(
        self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True
    ) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = list(params) if isinstance(params, Iterable) else [params]
        self.modifier_rank = modifier_rank
        self.enabled = enabled

    def __enter__(self):
        return self.params

    def __exit__(self, *exc) -> None:
        if not self.enabled or self.modifier_rank is None or not dist.is_initialized():
            return
        with torch.no_grad():
            for param in self.params:
                dist.broadcast(param.data, src=self.modifier_rank)
