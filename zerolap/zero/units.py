"""Stage 3's fetch units: which parameters are gathered together, and which stay whole.

A *unit* is the trainable parameters a module registers directly (not its children's). Before
the module runs, its units are all-gathered with one collective each; a parameter registered by
several modules (tied weights) belongs to the first one, in registration order, and is fetched
by every module that uses it.

A module whose direct parameters are fewer than ``param_persistence_threshold`` elements
(LayerNorms, small heads) is *persistent*: it stays whole on every rank, as in DeepSpeed,
because gathering it every time would cost more latency than its memory is worth. DeepSpeed
applies the threshold per parameter; zerolap applies it per module so that a large weight and its
small bias travel in one collective. At most ``model_persistence_threshold`` elements persist.
Consecutive persistent modules share one gradient bucket (up to ``reduce_bucket_size``); every
sharded unit is a bucket of its own, so the bucket that reduce-scatters its gradients is the
same range that all-gathers its parameters.

Units are ordered in reverse registration order, the order backward usually produces gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerolap.zero.status import full_numel

__all__ = ["UnitPlan", "plan_units"]


@dataclass(frozen=True)
class UnitPlan:
    params: list[torch.nn.Parameter]  # in layout order
    groups: list[list[int]]  # per bucket, the sizes of its parameters (layout_from_groups)
    persistent: list[bool]  # per bucket
    names: list[str]  # per bucket: the module(s) it holds
    fetch: dict[torch.nn.Module, list[int]]  # module -> buckets it needs gathered to run


def _owned_params(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module, list]]:
    """(module name, module, its trainable direct parameters not owned by an earlier module)."""
    seen: set[int] = set()
    owned = []
    for name, mod in module.named_modules():
        mine = []
        for param in mod.parameters(recurse=False):
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                mine.append(param)
        if mine:
            owned.append((name or "<root>", mod, mine))
    return owned


def plan_units(
    module: torch.nn.Module,
    *,
    persistence_threshold: int,
    model_persistence_threshold: int,
    bucket_numel: int,
) -> UnitPlan:
    owned = _owned_params(module)
    persistent_budget = model_persistence_threshold
    params: list[torch.nn.Parameter] = []
    groups: list[list[int]] = []
    persistent: list[bool] = []
    names: list[str] = []
    bucket_of: dict[int, int] = {}
    for name, _mod, mine in reversed(owned):
        numel = sum(full_numel(p) for p in mine)
        keep = numel < persistence_threshold and numel <= persistent_budget
        if keep:
            persistent_budget -= numel
        merge = keep and persistent and persistent[-1] and sum(groups[-1]) + numel <= bucket_numel
        if merge:
            names[-1] = f"{names[-1]}, {name}"
        else:
            groups.append([])
            persistent.append(keep)
            names.append(name)
        for param in mine:
            bucket_of[id(param)] = len(groups) - 1
            params.append(param)
            groups[-1].append(full_numel(param))
    fetch = {}
    for mod in module.modules():
        needed = sorted(
            {bucket_of[id(p)] for p in mod.parameters(recurse=False) if id(p) in bucket_of}
        )
        needed = [b for b in needed if not persistent[b]]
        if needed:
            fetch[mod] = needed
    return UnitPlan(params, groups, persistent, names, fetch)
