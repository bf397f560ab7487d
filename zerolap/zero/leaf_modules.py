"""Stage-3 *leaf* modules: a module whose whole subtree is gathered as one unit when it runs.

Some modules run only part of their children on a given batch (a mixture-of-experts block
routes tokens to a few experts): per-child gathering would then differ from rank to rank and
step to step. Marked as a leaf, the module's parameters and all its descendants' are fetched
together by the module's own hooks, and its children get none (``zero.units``).

The mark is ``module._z3_leaf = True``, DeepSpeed's attribute, so models marked for DeepSpeed
are marked for zerolap. ``zero_optimization.leaf_module`` marks them from the config at
``initialize`` (``apply_leaf_config``).

Fine-grained models pay per child: each module with parameters costs stage 3 a gather, a
reduction and four hooks per step, mostly host time that a GPU waits for when its kernels are
short. ``zero_optimization.stage3_module_granularity_threshold`` marks leaves by size
(``mark_leaves_by_granularity``), with DeepSpeed's measure and order, so a config tuned there
groups the same modules here.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import WARNING

import torch

from zerolap.zero.status import full_numel

__all__ = [
    "apply_granularity_threshold",
    "apply_leaf_config",
    "get_z3_leaf_modules",
    "granularities",
    "mark_leaves_by_granularity",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]


def z3_leaf_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is gathered as one unit with its whole subtree."""
    return getattr(module, "_z3_leaf", False) is True


def z3_leaf_parameter(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` belongs to a leaf module's unit (set by ``initialize``)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_module(module: torch.nn.Module, flag: bool) -> None:
    module._z3_leaf = flag


def _class_matches(module: torch.nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _mark_classes(
    model: torch.nn.Module, classes: Iterable[type | str], flag: bool, raise_if_not_found: bool
) -> list[torch.nn.Module]:
    classes = list(classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf module classes must be types or class names, got {bad}")
    marked = [m for m in model.modules() if any(_class_matches(m, c) for c in classes)]
    for module in marked:
        set_z3_leaf_module(module, flag)
    if not marked and raise_if_not_found:
        raise ValueError(f"no module of the classes {classes} in {type(model).__name__}")
    return marked


def set_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Mark every module of ``leaf_module_classes`` (types, class names or fully qualified
    names) as a leaf; returns the marked modules."""
    return _mark_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    return _mark_classes(model, leaf_module_classes, False, raise_if_not_found)


def _mark_names(
    model: torch.nn.Module, matches, wanted: list[str], flag: bool, raise_if_not_found: bool
) -> tuple[list[torch.nn.Module], list[str]]:
    marked, found = [], set()
    for name, module in model.named_modules():
        hits = [w for w in wanted if matches(name, w)]
        if hits:
            set_z3_leaf_module(module, flag)
            marked.append(module)
            found.update(hits)
    missing = [w for w in wanted if w not in found]
    if missing and raise_if_not_found:
        raise ValueError(f"no module of {type(model).__name__} matches {missing}")
    return marked, missing


def set_z3_leaf_modules_by_name(
    model: torch.nn.Module, module_names, flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[torch.nn.Module], list[str]]:
    """Mark the modules named exactly ``module_names`` (``named_modules`` names)."""
    return _mark_names(model, str.__eq__, list(module_names), flag, raise_if_not_found)


def set_z3_leaf_modules_by_suffix(
    model: torch.nn.Module, name_suffixes, flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[torch.nn.Module], list[str]]:
    """Mark the modules whose names end with one of ``name_suffixes``."""
    return _mark_names(model, str.endswith, list(name_suffixes), flag, raise_if_not_found)


def apply_leaf_config(model: torch.nn.Module, section) -> list[torch.nn.Module]:
    """Mark the leaves ``zero_optimization.leaf_module`` names (``classes``, ``names``,
    ``name_suffixes``); returns them. Names and suffixes that match no module are warned about
    (a misspelt name would otherwise silently leave the module per-child)."""
    from zerolap.utils.logging import logger

    marked = _mark_classes(model, section.classes, True, raise_if_not_found=False)
    by_name, missing = set_z3_leaf_modules_by_name(model, section.names, raise_if_not_found=False)
    by_suffix, unmatched = set_z3_leaf_modules_by_suffix(
        model, section.name_suffixes, raise_if_not_found=False
    )
    unknown = [f"names {n!r}" for n in missing] + [f"name_suffixes {s!r}" for s in unmatched]
    if unknown:
        logger.warning(f"zero_optimization.leaf_module: no module matches {', '.join(unknown)}")
    return list({id(m): m for m in marked + by_name + by_suffix}.values())


# Containers only hold modules and may never run themselves: their children keep their hooks.
# Told by class name, as DeepSpeed tells them: a subclass (torchvision's MLP is a Sequential)
# runs code of its own and counts as a module.
_CONTAINERS = frozenset(torch.nn.modules.container.__all__)
# A leaf is gathered whole while it runs: a subtree larger than this never becomes one, however
# fine its modules (DeepSpeed's bound, so both group the same modules).
MAX_LEAF_NUMEL = 1_000_000_000


def granularities(model: torch.nn.Module) -> dict[torch.nn.Module, int]:
    """DeepSpeed's *granularity* of each module that may become a leaf: its subtree's parameter
    elements (full sizes, also when sharded) floor-divided by the modules counted in it, itself
    included. Modules without children count one; containers (torch's own classes, by name)
    count their children but not themselves and are never leaves; modules holding no
    parameter count nothing. Modules without children, containers and subtrees over
    ``MAX_LEAF_NUMEL`` elements are left out."""
    found: dict[torch.nn.Module, int] = {}

    def visit(module: torch.nn.Module) -> tuple[int, int]:
        if next(module.parameters(), None) is None:
            return 0, 0
        numel = sum(full_numel(p) for p in module.parameters(recurse=False))
        children = list(module.children())
        if not children:
            return 1, numel
        count = 0
        for child in children:
            child_count, child_numel = visit(child)
            count += child_count
            numel += child_numel
        if type(module).__name__ in _CONTAINERS:
            return count, numel
        count += 1
        if numel <= MAX_LEAF_NUMEL:
            found[module] = numel // count
        return count, numel

    visit(model)
    return found


def mark_leaves_by_granularity(
    model: torch.nn.Module, threshold: int
) -> tuple[list[torch.nn.Module], dict[torch.nn.Module, int]]:
    """Mark as leaves the outermost modules whose granularity is at most ``threshold``,
    looking at a module's children only when it is not marked itself. The model itself is
    never a leaf (as when marked by hand, ``zero.units``): when it qualifies, its children are
    looked at. Returns the marked modules and every module's granularity."""
    sizes = granularities(model)
    marked: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        if module is not model and sizes.get(module, threshold + 1) <= threshold:
            set_z3_leaf_module(module, True)
            marked.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return marked, sizes


def apply_granularity_threshold(model: torch.nn.Module, threshold: int) -> list[torch.nn.Module]:
    """``zero_optimization.stage3_module_granularity_threshold``: mark the leaves it selects and
    say which, or, when none qualifies, which module is finest and what threshold would take
    it (DeepSpeed warns likewise), once, on rank 0."""
    from zerolap.utils.logging import log_dist

    key = "zero_optimization.stage3_module_granularity_threshold"
    marked, sizes = mark_leaves_by_granularity(model, threshold)
    names = {module: name or "<model>" for name, module in model.named_modules()}
    if marked:
        shown = ", ".join(f"'{names[m]}' ({sizes[m]:,})" for m in marked[:4])
        more = f" and {len(marked) - 4} more" if len(marked) > 4 else ""
        log_dist(
            f"{key} {threshold:,}: {len(marked)} modules gathered whole with their children, "
            f"one collective each (granularity in elements per module): {shown}{more}",
            ranks=[0],
        )
        return marked
    candidates = {m: g for m, g in sizes.items() if m is not model}
    if not candidates:
        log_dist(f"{key} {threshold:,}: no module has children to gather with it", [0], WARNING)
        return marked
    finest = min(candidates, key=candidates.get)
    log_dist(
        f"{key} {threshold:,} groups no module: the finest is '{names[finest]}' with "
        f"{candidates[finest]:,} elements per module; a threshold at least that groups it",
        [0],
        WARNING,
    )
    return marked
