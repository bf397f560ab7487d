"""Expert parallelism's set-up and naming: which ranks an MoE layer's experts are spread over,
which experts this rank holds, and what they are called in the model with every expert.

A layer of ``ep_size`` E gets its expert-parallel group from the mesh (``zerolap.topology``);
its experts' parameters carry DeepSpeed's mark "ep_size_E", which is what the engine reads to
reduce and shard them over the ranks holding the same experts. Local copy i of
expert-parallel rank e is expert e x L + i (L experts per rank), as in DeepSpeed; checkpoints
and consolidated state dicts use those global indices, so they mean the same experts at any E.
"""

from __future__ import annotations

import re

import torch

import zerolap.comm as dist
from zerolap.moe.layer import Experts, MOELayer
from zerolap.moe.utils import is_moe_param

__all__ = [
    "expert_buffers",
    "expert_parallel_size",
    "global_expert_names",
    "set_up_expert_parallelism",
    "with_every_expert",
]


def expert_parallel_size(param: torch.Tensor) -> int:
    """The expert-parallel size E of an expert parameter (its ``group_name`` "ep_size_E"); 1
    for any other parameter."""
    found = re.fullmatch(r"ep_size_(\d+)", str(getattr(param, "group_name", "")))
    return int(found.group(1)) if is_moe_param(param) and found else 1


def _spread_layers(module: torch.nn.Module) -> list[MOELayer]:
    return [m for m in module.modules() if isinstance(m, MOELayer) and m.ep_size > 1]


def expert_buffers(module: torch.nn.Module) -> set[int]:
    """Ids of the buffers of experts spread over ranks (each rank holds its own experts')."""
    return {id(b) for layer in _spread_layers(module) for b in layer.experts.buffers()}


def set_up_expert_parallelism(module: torch.nn.Module, mesh, *, stage: int) -> int:
    """The expert-parallel size of ``module``'s experts (1 without expert parallelism), after
    giving each MoE layer its group (``mesh.expert_groups``: every rank calls this alike).
    What zerolap does not run is refused by name: experts of several sizes above 1 in one
    model, a spread layer whose experts are not marked with its size (they would be reduced
    as one), and expert parallelism with ZeRO stage 3, tensor, pipeline or sequence
    parallelism."""
    layers = _spread_layers(module)
    names = {id(p): n for n, p in module.named_parameters()}
    for layer in layers:
        for param in layer.experts.parameters():
            if expert_parallel_size(param) != layer.ep_size:
                raise ValueError(
                    f"expert parameter {names.get(id(param), '?')} of a MoE layer with "
                    f"ep_size={layer.ep_size} is marked group_name="
                    f"{getattr(param, 'group_name', None)!r}: its experts must be marked "
                    f"'ep_size_{layer.ep_size}' (Experts(..., expert_group_name=...)), or ranks "
                    "holding different experts would average them"
                )
    sizes = {layer.ep_size for layer in layers}
    sizes |= {expert_parallel_size(p) for p in module.parameters()} - {1}
    if not sizes:
        return 1
    if len(sizes) > 1:
        raise NotImplementedError(
            f"the model's experts are of expert-parallel sizes {sorted(sizes)}: zerolap runs "
            "one expert-parallel size above 1 per model"
        )
    (size,) = sizes
    if stage == 3:
        raise NotImplementedError(
            f"MoE ep_size={size} with ZeRO stage 3: stage 3 shards every parameter over the "
            "data-parallel group, and experts spread over ranks need theirs sharded over the "
            "ranks holding the same experts; use stage 0, 1 or 2 (DeepSpeed refuses MoE at "
            "stage 3), or ep_size=1"
        )
    if mesh.dims.tensor > 1 or mesh.dims.pipe > 1 or mesh.dims.sequence > 1:
        raise NotImplementedError(
            f"MoE ep_size={size} with tensor, pipeline or sequence parallelism: zerolap "
            "spreads experts over data-parallel ranks only"
        )
    group = mesh.expert_groups(size).expert_group
    for layer in layers:
        layer._set_ep_group(group)
    return size


def global_expert_names(module: torch.nn.Module) -> dict[str, str]:
    """State-dict key -> the key the model with every expert on one rank gives it, for each
    entry of an expert this rank holds as a local copy numbered otherwise (local copy i of
    expert-parallel rank e is expert e x L + i); keys of other entries are absent."""
    renamed = {}
    for prefix, sub in module.named_modules():
        if not isinstance(sub, Experts) or sub.first_expert == 0:
            continue
        base = f"{prefix}.deepspeed_experts." if prefix else "deepspeed_experts."
        for key in sub.deepspeed_experts.state_dict(keep_vars=True):
            local, rest = key.split(".", 1)
            renamed[base + key] = f"{base}{sub.first_expert + int(local)}.{rest}"
    return renamed


def with_every_expert(module: torch.nn.Module, state: dict, *, exclude_frozen: bool) -> dict:
    """Rank 0's whole state dict ``state`` completed with the experts the other ranks of its
    expert-parallel group hold, under their global names (others: ``state``, as it is). A
    collective over that group: call it on every rank."""
    layers = [layer for layer in _spread_layers(module) if layer.ep_group is not None]
    if not layers:
        return state
    group = layers[0].ep_group
    if dist.get_global_rank(group, 0) != 0:
        return state  # another copy of the same experts
    renamed = global_expert_names(module)
    mine = {
        renamed[key]: tensor.detach().to("cpu", copy=True)
        for key, tensor in module.state_dict(keep_vars=True).items()
        if key in renamed
        and not (
            exclude_frozen and isinstance(tensor, torch.nn.Parameter) and not tensor.requires_grad
        )
    }
    gathered = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0, group=group)
    for part in gathered or []:
        state.update(part)
    return state
