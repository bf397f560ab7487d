"""Which layers each pipeline stage holds: contiguous runs balanced by a weight per layer.

Pure arithmetic with its own unit tests. ``bounds[s]:bounds[s + 1]`` are stage ``s``'s layer
indices. The split minimises the heaviest stage (the pipeline runs at its pace), every stage
gets at least one layer, and layers of weight 0 (functions, dropout) join the stage before them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["balanced_bounds", "layer_weights"]


def layer_weights(method: str, *, param_counts: Sequence[int], type_names: Sequence[str]):
    """Each layer's weight under DeepSpeed's ``partition_method``: ``parameters`` (trainable
    parameter count), ``uniform`` (1 each), ``type:<regex>`` (1 for layers whose class name,
    or a function's own name, matches, case-insensitively, else 0)."""
    lowered = method.lower()
    if lowered == "parameters":
        return list(param_counts)
    if lowered == "uniform":
        return [1] * len(type_names)
    if lowered.startswith("type:"):
        pattern = re.compile(method[5:], re.IGNORECASE)
        weights = [1 if pattern.search(name) else 0 for name in type_names]
        if not any(weights):
            raise ValueError(
                f"partition_method={method!r}: no layer's name matches; the layers are "
                f"{sorted(set(type_names))}"
            )
        return weights
    raise ValueError(f"partition_method={method!r}: use 'parameters', 'uniform' or 'type:<regex>'")


def balanced_bounds(weights: Sequence[int], stages: int) -> list[int]:
    """``stages + 1`` layer indices splitting ``weights`` into contiguous, non-empty runs whose
    heaviest is as light as possible, and among such splits an even one where a simple rule
    finds it (13 equal layers in 4 stages: 4, 3, 3, 3 rather than 4, 4, 4, 1, which matters
    when a rank holds several stages' chunks)."""
    if stages < 1:
        raise ValueError(f"the number of pipeline stages must be at least 1, got {stages}")
    if len(weights) < stages:
        raise ValueError(
            f"{len(weights)} layer(s) cannot be split into {stages} pipeline stages: every "
            "stage needs at least one layer"
        )
    low, high = max(weights, default=0), sum(weights)
    while low < high:  # the lightest heaviest-stage weight a split can reach
        cap = (low + high) // 2
        if _split(weights, stages, cap, even=False) is None:
            low = cap + 1
        else:
            high = cap
    bounds = _split(weights, stages, low, even=True) or _split(weights, stages, low, even=False)
    assert bounds is not None  # the total always fits
    return bounds


def _split(weights: Sequence[int], stages: int, cap: int, even: bool) -> list[int] | None:
    """Greedy: each stage takes layers until the next would pass ``cap`` (with ``even``, also
    once it holds its even share of what is left: the remaining weight over the remaining
    stages, rounded up), or until only as many layers are left as stages still to fill. None
    when that needs more than ``stages``."""
    bounds, size, total = [0], 0, len(weights)
    share = -(-sum(weights) // stages)
    for index, weight in enumerate(weights):
        open_has_layers = index > bounds[-1]
        just_enough_left = total - index == stages - len(bounds)
        full = size + weight > cap or (even and weight > 0 and size >= share)
        if open_has_layers and (full or just_enough_left):
            bounds.append(index)
            size = 0
            share = -(-sum(weights[index:]) // max(stages - len(bounds) + 1, 1))
        size += weight
    bounds.append(total)
    return bounds if len(bounds) - 1 <= stages and size <= cap else None
