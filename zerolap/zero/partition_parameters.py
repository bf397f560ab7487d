"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters`` module: the stage-3 names
clients import from it, and two helpers transformers patches.

``zero_wrapper_for_fp_tensor_constructor`` and ``_orig_torch_arange`` are read, replaced and
restored by transformers around ``zero.Init`` (its ``prevent_arange_dtype_change``), so they
must exist here. zerolap's ``Init`` does not wrap torch's tensor constructors (it casts each
parameter to the training dtype as it shards it), so the wrapper only serves whoever calls it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from zerolap.accelerator import get_accelerator
from zerolap.zero.external import register_external_parameter, unregister_external_parameter
from zerolap.zero.gathered import GatheredParameters
from zerolap.zero.init import Init
from zerolap.zero.status import ParamStatus, ZeroParamStatus

__all__ = [
    "GatheredParameters",
    "Init",
    "ParamStatus",
    "ZeroParamStatus",
    "get_accelerator",
    "register_external_parameter",
    "unregister_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable, target_fp_dtype: torch.dtype, target_device=None
) -> Callable:
    """``fn`` (a tensor constructor) made to build on ``target_device`` (default: the
    accelerator's device) and to cast floating-point results to ``target_fp_dtype``."""
    device = target_device if target_device is not None else get_accelerator().device()

    @functools.wraps(fn)
    def build(*args, **kwargs):
        kwargs.setdefault("device", device)
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return build
