"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters`` names, and external parameters.

``register_external_parameter(module, param)`` says that ``module``'s forward uses ``param``
although another module registers it (a weight passed to a sibling, a parametrization's
original tensors): under stage 3 the unit holding ``param`` is then gathered around
``module``'s forward and backward as well. It may be called before ``initialize`` (model code
does, in ``__init__``: the mark is kept on the module and read when the units are planned)
or after (the engine's fetcher adds the unit to the module's hooks at once).
"""

from __future__ import annotations

import torch

from zerolap.zero.gathered import GatheredParameters
from zerolap.zero.init import Init
from zerolap.zero.status import ParamStatus, ZeroParamStatus

__all__ = [
    "GatheredParameters",
    "Init",
    "ParamStatus",
    "ZeroParamStatus",
    "external_parameters",
    "register_external_parameter",
    "unregister_external_parameter",
]


def external_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters registered as used by ``module`` though registered elsewhere."""
    return list(getattr(module, "ds_external_parameters", {}).values())


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError(
            f"register_external_parameter: expected a torch.nn.Parameter, got {type(parameter)}"
        )
    if not hasattr(module, "ds_external_parameters"):
        module.ds_external_parameters = {}
    module.ds_external_parameters[id(parameter)] = parameter
    fetcher = getattr(getattr(parameter, "ds_owner", None), "fetcher", None)
    if fetcher is not None:
        fetcher.add_external(module, parameter)


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    getattr(module, "ds_external_parameters", {}).pop(id(parameter), None)
