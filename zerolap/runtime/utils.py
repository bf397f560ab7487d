"""``deepspeed.runtime.utils``: the helpers DeepSpeed's example scripts import from it."""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from typing import Any

import psutil
import torch

import zerolap.comm as dist
from zerolap.accelerator import get_accelerator
from zerolap.utils.logging import logger

__all__ = ["move_to_device", "see_memory_usage", "set_random_seed"]

_GB = 1 << 30


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


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log ``message`` and this process's memory, on rank 0, when ``force``: the accelerator's
    allocated (MA) and reserved (CA) bytes with their peaks since the last call (on a CPU-only
    host both are this process's resident set, which is what it has allocated), and the host's
    memory in use. The peaks are reset, so successive calls bracket phases. Without ``force`` it
    does nothing, as DeepSpeed's does, so scripts can leave their calls in."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()  # what is unreachable but not yet freed is not the caller's to see
    acc = get_accelerator()
    gb = {
        "MA": acc.memory_allocated(),
        "Max_MA": acc.max_memory_allocated(),
        "CA": acc.memory_reserved(),
        "Max_CA": acc.max_memory_reserved(),
    }
    host = psutil.virtual_memory()
    logger.info(message)
    logger.info(" ".join(f"{name} {value / _GB:.2f} GB" for name, value in gb.items()))
    logger.info(
        f"CPU Virtual Memory: used = {(host.total - host.available) / _GB:.2f} GB, "
        f"percent = {host.percent}%"
    )
    acc.reset_peak_memory_stats()
