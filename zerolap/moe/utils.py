"""DeepSpeed's mixture-of-experts parameter helpers, for models whose expert parameters are
marked as DeepSpeed marks them (``param.allreduce = False``, ``param.group_name =
"ep_size_<E>"``).

The optimizer groups they build put expert parameters in groups of their own (``moe: True``,
named by the expert group); zerolap's optimizer takes such groups like any others. What decides
how an expert parameter is reduced and sharded is its mark, not its group (``moe.parallel``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

__all__ = [
    "configure_moe_param_groups",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]


def is_moe_param(param: torch.Tensor) -> bool:
    return hasattr(param, "allreduce") and not param.allreduce


def is_moe_param_group(param_group: dict) -> bool:
    return param_group.get("moe", False)


def split_params_into_shared_and_expert_params(params):
    shared = [p for p in params if not is_moe_param(p)]
    return shared, [p for p in params if is_moe_param(p)]


def _chunks(params: list, max_numel: float) -> list[list]:
    """``params`` in order, cut into lists of at most ``max_numel`` elements (a larger
    parameter alone)."""
    chunks: list[list] = [[]]
    size = 0
    for param in params:
        numel = getattr(param, "ds_numel", param.numel())
        if chunks[-1] and size + numel > max_numel:
            chunks.append([])
            size = 0
        chunks[-1].append(param)
        size += numel
    return [c for c in chunks if c]


def split_params_into_different_moe_groups_for_optimizer(
    param_groups, max_group_size: float | None = 178956971
) -> list[dict[str, Any]]:
    """Each group's expert parameters moved into copies of it, one per expert group
    (``name`` the expert group's, ``moe: True``), split at ``max_group_size`` elements; the
    groups (each needs a ``name``) keep the rest. Without expert parameters: the groups, as a
    list."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError(f"param groups must be a dict, list or tuple, got {type(param_groups)}")
    expert_groups: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for group in param_groups:
        kept = []
        for param in group["params"]:
            if is_moe_param(param):
                expert_groups[group["name"]][param.group_name].append(param)
            else:
                kept.append(param)
        group["params"] = kept
    parents = {group["name"]: group for group in param_groups if "name" in group}
    for parent_name, by_expert_group in expert_groups.items():
        for name, params in by_expert_group.items():
            parts = _chunks(params, max_group_size) if max_group_size is not None else [params]
            for part in parts:
                param_groups.append(
                    {**parents[parent_name], "name": name, "moe": True, "params": part}
                )
    return param_groups


def configure_moe_param_groups(model_parameters: list):
    """``model_parameters`` (parameters, or groups) with expert groups split out, unless some
    already are."""
    if not isinstance(model_parameters, list):
        raise TypeError("model_parameters must be a list")
    if model_parameters and isinstance(model_parameters[0], dict):
        if any("moe" in group for group in model_parameters):
            return model_parameters
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    group = {"params": model_parameters, "name": "dense-params"}
    return split_params_into_different_moe_groups_for_optimizer(group)
