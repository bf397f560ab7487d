"""DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*``: one parameter's fp32 value, gradient
and optimizer state, assembled from the shards (``zero.param_access``). Collectives when the
optimizer is sharded: call them on every rank. A parameter no engine trains gives None."""

from __future__ import annotations

import torch

from zerolap.zero.param_access import access_of

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
]


def _access(param: torch.Tensor, what: str):
    access = access_of(param)
    if access is None and what.startswith("set"):
        raise ValueError(
            f"safe_{what}: this parameter is not trained by a zerolap engine (frozen, outside "
            "the optimizer, or the engine was destroyed)"
        )
    if access is not None:  # the shards it reads may be parked by offload_states()
        access.optimizer.parked.require(f"safe_{what}()")
    return access


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole parameter in fp32 (the master copy under mixed precision), on CPU."""
    access = _access(param, "get_full_fp32_param")
    return None if access is None else access.fp32_value(param)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole averaged fp32 gradient accumulated since the last step (between backward
    and step), on CPU; None outside that window or for a parameter no engine trains."""
    access = _access(param, "get_full_grad")
    return None if access is None else access.grad(param)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The whole per-element optimizer state ``optim_state_key`` (Adam: ``exp_avg``,
    ``exp_avg_sq``), on CPU; None before the first step."""
    access = _access(param, "get_full_optimizer_state")
    return None if access is None else access.optimizer_state(param, optim_state_key)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the whole parameter (fp32 master and the training-dtype copy on every rank)."""
    _access(param, "set_full_fp32_param").set_fp32_value(param, value)


def safe_set_full_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set the whole per-element optimizer state ``optim_state_key`` (after the first step)."""
    _access(param, "set_full_optimizer_state").set_optimizer_state(param, value, optim_state_key)
