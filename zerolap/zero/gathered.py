"""``GatheredParameters``: full parameters inside a ``with`` block.

Stage-3 parameters (sharded by the engine or by ``zero.Init``) are gathered on entry, held so
that no module hook releases them underneath, and released on exit. With ``modifier_rank`` set,
that rank's values are broadcast on exit and every rank keeps its chunk of them (and the fp32
master follows), so changes made there survive. With ``fwd_module``, the sharded parameters
are also registered as used by that module's forward (``register_external_parameter``).
Parameters that are not sharded (stages 0-2) are whole already, once the last step's gathers
have arrived (waited on entry); with ``modifier_rank`` they are broadcast so the copies stay
identical.

A collective: every rank must enter with the same parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

import zerolap.comm as dist
from zerolap.zero.external import register_external_parameter
from zerolap.zero.in_flight import settle_params
from zerolap.zero.status import is_sharded

__all__ = ["GatheredParameters"]


class GatheredParameters:
    def __init__(
        self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True
    ) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        elif params is None:
            params = []
        params = list(params) if isinstance(params, Iterable) else [params]
        # Clients pass lists with None (a missing bias), buffers and plain tensors beside
        # parameters, and generators: the tensors are kept, in order, each once.
        unique = {id(p): p for p in params if isinstance(p, torch.Tensor)}
        self.params = list(unique.values())
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self.enabled = enabled
        self._held: list[tuple[object, object]] = []

    def __enter__(self):
        if not self.enabled:
            return self.params
        settle_params(self.params)  # stages 1-2: the last step's gathers, arrived
        by_owner: dict[int, tuple[object, list]] = {}
        for param in self.params:
            if is_sharded(param):
                by_owner.setdefault(id(param.ds_owner), (param.ds_owner, []))[1].append(param)
                if self.fwd_module is not None:
                    register_external_parameter(self.fwd_module, param)
        self._held = [(owner, owner.hold(params)) for owner, params in by_owner.values()]
        return self.params

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        for owner, token in self._held:
            owner.unhold(token, self.modifier_rank)
        self._held = []
        if self.modifier_rank is None or not dist.is_initialized():
            return
        with torch.no_grad():
            for param in self.params:
                if not is_sharded(param):  # a model not moved to its device yet, too
                    dist.through_group_device(dist.broadcast, param.data, src=self.modifier_rank)
