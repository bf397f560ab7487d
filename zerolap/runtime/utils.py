"""``deepspeed.runtime.utils``: the helpers DeepSpeed's example scripts import from it."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["move_to_device", "set_random_seed"]


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators on this process."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % 2**32)  # NumPy takes 32-bit seeds only
    torch.manual_seed(seed)


def move_to_device(item: Any, device, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """``item`` moved to ``device``, looking inside lists, tuples and dicts (rebuilt).

    Every leaf is moved with ``.to(device)``; a leaf that ``criterion_func`` picks is moved in
    place instead (its storage replaced, so references held elsewhere see the move) and
    returned itself, as DeepSpeed's pipeline engine relies on."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(value, device, criterion_func) for value in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(value, device, criterion_func) for value in item)
    if isinstance(item, dict):
        return {key: move_to_device(value, device, criterion_func) for key, value in item.items()}
    return item.to(device)
