"""The model's state dict with whole parameters, as a plain ``torch.nn.Module`` would give it.

Under stage 3 each module's sharded parameters are gathered together, copied to CPU on rank 0
and released before the next module's, so no rank ever holds more than one module's parameters
beyond what it kept already. Stages 0-2 hold every parameter whole; nothing is gathered.
Tensor-parallel pieces are joined over their tensor group into the whole parameter, and
experts spread over ranks are gathered from rank 0's expert-parallel group under their global
names (``moe.parallel``).
"""

from __future__ import annotations

import torch

import zerolap.comm as dist
from zerolap.moe.parallel import with_every_expert
from zerolap.tensor_parallel.layers import join_pieces
from zerolap.zero.gathered import GatheredParameters
from zerolap.zero.status import is_sharded

__all__ = ["full_state_dict"]


def full_state_dict(module: torch.nn.Module, *, exclude_frozen: bool = False) -> dict:
    """On rank 0 the whole state dict on CPU (keys and order of ``module.state_dict()``); on
    the other ranks an empty dict. A collective under stage 3: call it on every rank."""
    on_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    entries = module.state_dict(keep_vars=True)
    by_module: dict[str, list[str]] = {}
    for key in entries:
        by_module.setdefault(key.rpartition(".")[0], []).append(key)
    out = {}
    copies: dict[int, torch.Tensor] = {}  # a tied weight is one tensor under each of its keys
    for keys in by_module.values():
        sharded = [entries[k] for k in keys if is_sharded(entries[k])]
        with GatheredParameters(sharded):
            for key in keys:
                tensor = entries[key]
                frozen = isinstance(tensor, torch.nn.Parameter) and not tensor.requires_grad
                if exclude_frozen and frozen:
                    continue
                split = getattr(tensor, "tp_split", None)
                if split is not None and id(tensor) not in copies:
                    # A collective: every rank joins, in the same order.
                    whole = join_pieces(tensor, split, tensor.tp_group)
                    copies[id(tensor)] = whole.to("cpu") if on_rank0 else whole[:0]
                if on_rank0:
                    if id(tensor) not in copies:
                        copies[id(tensor)] = tensor.detach().to("cpu", copy=True)
                    out[key] = copies[id(tensor)]
    return with_every_expert(module, out, exclude_frozen=exclude_frozen)
