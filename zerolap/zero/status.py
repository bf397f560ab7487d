"""The state of a stage-3 parameter, kept on the parameter as DeepSpeed does.

A sharded parameter carries ``ds_status`` (a ``ParamStatus``), ``ds_shape`` and ``ds_numel``
(its full shape and size, while ``.data`` is empty), ``ds_id`` (unique in the process; tied
weights are one parameter and have one id), ``ds_tensor`` (this rank's elements of it) and
``ds_owner``: the object that can gather it (``zero.Init``'s partition before ``initialize``,
the engine's ``ShardedParams`` after).
"""

from __future__ import annotations

import enum
import itertools

import torch

__all__ = [
    "ParamStatus",
    "ZeroParamStatus",
    "full_numel",
    "full_shape",
    "is_sharded",
    "mark",
    "unmark",
]


class ParamStatus(enum.Enum):
    SHARDED = "sharded"  # only this rank's shard exists; .data is empty
    GATHERING = "gathering"  # an all-gather is in flight
    AVAILABLE = "available"  # .data holds the full parameter
    # DeepSpeed's names for the same states (aliases: the same members).
    NOT_AVAILABLE = "sharded"
    INFLIGHT = "gathering"


ZeroParamStatus = ParamStatus
"""DeepSpeed's name: ``param.ds_status == ZeroParamStatus.NOT_AVAILABLE`` works unchanged."""

_ids = itertools.count()


def mark(param: torch.nn.Parameter, status: ParamStatus, owner=None) -> None:
    if not hasattr(param, "ds_shape"):
        param.ds_shape = tuple(param.shape)
        param.ds_numel = param.numel()
        param.ds_id = next(_ids)
    param.ds_status = status
    if owner is not None:
        param.ds_owner = owner


def unmark(param: torch.nn.Parameter) -> None:
    """``param`` is an ordinary whole tensor again: no stage-3 attributes."""
    attributes = ("ds_status", "ds_owner", "ds_shape", "ds_numel", "ds_id", "ds_tensor")
    for name in (*attributes, "ds_active_sub_modules"):
        if hasattr(param, name):
            delattr(param, name)


def is_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is managed by a stage-3 partition (whatever its current status)."""
    return hasattr(param, "ds_status")


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter, sharded or not."""
    return param.ds_numel if is_sharded(param) else param.numel()


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(param.ds_shape) if is_sharded(param) else tuple(param.shape)
