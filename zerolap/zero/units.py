"""Stage 3's fetch units: which parameters are gathered together, and which stay whole.

A *unit* is the parameters a module registers directly (not its children's), or, for a leaf
module (``zero.leaf_modules``), those of its whole subtree. Trainable and frozen parameters of
one module form separate units, so that a frozen unit never takes part in gradient reduction.
Before the module runs, its units are all-gathered with one collective each; a parameter
registered by several modules (tied weights) belongs to the first one, in registration order,
and is fetched by every module that registers it or names it with
``register_external_parameter``.

A module whose direct parameters are fewer than ``param_persistence_threshold`` elements
(LayerNorms, small heads) is *persistent*: it stays whole on every rank, as in DeepSpeed,
because gathering it every time would cost more latency than its memory is worth. DeepSpeed
applies the threshold per parameter; zerolap applies it per module so that a large weight and its
small bias travel in one collective. At most ``model_persistence_threshold`` elements persist.
Consecutive persistent units share one bucket (up to ``reduce_bucket_size``); every sharded unit
is a bucket of its own, the range one all-gather fills. Gradients are reduced in runs of
consecutive buckets up to ``reduce_bucket_size`` (``layout.coalesce``), one reduce-scatter per
run that hands each rank its chunk of every unit in it.

Layout order: the trainable units first, in reverse registration order (the order backward
usually produces gradients), then the frozen ones. The trainable buckets are thus a prefix of
the layout (``trainable_buckets``), which is all the gradient reducer and the optimizer see;
the parameter store holds every unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerolap.zero.external import external_parameters
from zerolap.zero.leaf_modules import z3_leaf_module
from zerolap.zero.status import full_numel

__all__ = ["UnitPlan", "plan_units"]


@dataclass(frozen=True)
class UnitPlan:
    params: list[torch.nn.Parameter]  # in layout order: trainable ones, then frozen ones
    groups: list[list[int]]  # per bucket, the sizes of its parameters (layout_from_groups)
    persistent: list[bool]  # per bucket
    names: list[str]  # per bucket: the module(s) it holds
    fetch: dict[torch.nn.Module, list[int]]  # module -> buckets it needs gathered to run
    trainable_buckets: int  # buckets [0, trainable_buckets) hold the trainable parameters

    @property
    def trainable_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.params if p.requires_grad]


@dataclass(frozen=True)
class _Owner:
    name: str
    module: torch.nn.Module
    params: list[torch.nn.Parameter]  # not owned by an earlier module


def _leaf_descendants(root: torch.nn.Module) -> set[int]:
    """ids of the modules below a leaf module: their parameters are the leaf's."""
    prefixes: list[str] = []
    inside: set[int] = set()
    for name, module in root.named_modules():
        if any(name.startswith(prefix) for prefix in prefixes):
            inside.add(id(module))
        elif module is not root and z3_leaf_module(module):
            prefixes.append(f"{name}.")
    return inside


def _owners(root: torch.nn.Module, below_leaf: set[int]) -> list[_Owner]:
    """Each module that owns parameters: its direct ones, or a leaf's whole subtree's."""
    seen: set[int] = set()
    owners = []
    for name, module in root.named_modules():
        if id(module) in below_leaf:
            continue
        leaf = z3_leaf_module(module) and module is not root
        mine = []
        for param in module.parameters(recurse=leaf):
            if id(param) not in seen:
                seen.add(id(param))
                mine.append(param)
                if leaf:
                    param.ds_z3_leaf_module = module
        if mine:
            owners.append(_Owner(name or "<root>", module, mine))
    return owners


class _Planner:
    """Buckets in layout order, merging consecutive persistent ones."""

    def __init__(self, *, bucket_numel: int) -> None:
        self.bucket_numel = bucket_numel
        self.params: list[torch.nn.Parameter] = []
        self.groups: list[list[int]] = []
        self.persistent: list[bool] = []
        self.names: list[str] = []
        self.bucket_of: dict[int, int] = {}

    def add(self, name: str, params: list[torch.nn.Parameter], keep: bool) -> None:
        numel = sum(full_numel(p) for p in params)
        merge = (
            keep
            and self.persistent
            and self.persistent[-1]
            and sum(self.groups[-1]) + numel <= self.bucket_numel
            and self.params[-1].requires_grad == params[0].requires_grad
        )
        if merge:
            self.names[-1] = f"{self.names[-1]}, {name}"
        else:
            self.groups.append([])
            self.persistent.append(keep)
            self.names.append(name)
        for param in params:
            self.bucket_of[id(param)] = len(self.groups) - 1
            self.params.append(param)
            self.groups[-1].append(full_numel(param))


def plan_units(
    module: torch.nn.Module,
    *,
    persistence_threshold: int,
    model_persistence_threshold: int,
    bucket_numel: int,
) -> UnitPlan:
    below_leaf = _leaf_descendants(module)
    owners = list(reversed(_owners(module, below_leaf)))
    budget = model_persistence_threshold

    def persists(numel: int) -> bool:
        nonlocal budget
        keep = numel < persistence_threshold and numel <= budget
        if keep:
            budget -= numel
        return keep

    planner = _Planner(bucket_numel=bucket_numel)
    for trainable in (True, False):
        for owner in owners:
            params = [p for p in owner.params if p.requires_grad == trainable]
            if params:
                name = owner.name if trainable else f"{owner.name} (frozen)"
                planner.add(name, params, persists(sum(full_numel(p) for p in params)))
        if trainable:
            trainable_buckets = len(planner.groups)
    fetch = {}
    for mod in module.modules():
        if id(mod) in below_leaf:
            continue  # fetched by its leaf
        recurse = z3_leaf_module(mod) and mod is not module
        used = [*mod.parameters(recurse=recurse), *external_parameters(mod)]
        needed = {planner.bucket_of[id(p)] for p in used if id(p) in planner.bucket_of}
        needed = sorted(b for b in needed if not planner.persistent[b])
        if needed:
            fetch[mod] = needed
    return UnitPlan(
        planner.params,
        planner.groups,
        planner.persistent,
        planner.names,
        fetch,
        trainable_buckets,
    )
