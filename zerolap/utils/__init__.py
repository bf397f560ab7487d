"""``zerolap.utils`` (``deepspeed.utils``): the logger, stage-3 leaf modules, per-parameter
access to sharded state, checkpoint conversion, and ``RepeatingLoader``."""

from zerolap.utils.data import RepeatingLoader
from zerolap.utils.logging import log_dist, logger
from zerolap.utils.tensor_access import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from zerolap.zero.leaf_modules import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = [
    "RepeatingLoader",
    "get_z3_leaf_modules",
    "log_dist",
    "logger",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
    "zero_to_fp32",
]


def __getattr__(name: str):
    # ``deepspeed.utils.zero_to_fp32`` as an attribute, imported on first use: imported here
    # eagerly, ``python -m zerolap.utils.zero_to_fp32`` would find its own module already
    # loaded and warn.
    if name == "zero_to_fp32":
        from importlib import import_module

        return import_module("zerolap.utils.zero_to_fp32")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
