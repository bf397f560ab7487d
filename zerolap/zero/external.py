"""External parameters: ``register_external_parameter(module, param)`` says that ``module``'s
forward uses ``param`` although another module registers it (a weight passed to a sibling, a
parametrization's original tensors). Under stage 3 the unit holding ``param`` is then gathered
around ``module``'s forward and backward as well.

It may be called before ``initialize`` (model code does, in ``__init__``, inside ``zero.Init``:
the registration is kept on the module, in DeepSpeed's ``module._external_params``, and read
when the units are planned) or after (the engine's fetcher adds the unit to the module's hooks
at once). ``module.ds_external_parameters()`` lists them as ``(key, param)`` pairs, as
DeepSpeed's method does.
"""

from __future__ import annotations

import types

import torch

__all__ = [
    "ensure_registry",
    "external_parameters",
    "register_external_parameter",
    "unregister_external_parameter",
]


def _ds_external_parameters(module: torch.nn.Module):
    return module._external_params.items()


def ensure_registry(module: torch.nn.Module) -> None:
    """Give ``module`` DeepSpeed's external-parameter registry and its lister."""
    if not hasattr(module, "_external_params"):
        module._external_params = {}
        module.ds_external_parameters = types.MethodType(_ds_external_parameters, module)


def external_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters registered as used by ``module`` though registered elsewhere."""
    return list(getattr(module, "_external_params", {}).values())


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError(
            f"register_external_parameter: expected a torch.nn.Parameter, got {type(parameter)}"
        )
    ensure_registry(module)
    module._external_params[id(parameter)] = parameter
    fetcher = getattr(getattr(parameter, "ds_owner", None), "fetcher", None)
    if fetcher is not None:
        fetcher.add_external(module, parameter)


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo ``register_external_parameter`` (a unit already hooked stays gathered around the
    module until the engine is rebuilt)."""
    if id(parameter) not in getattr(module, "_external_params", {}):
        name = type(module).__name__
        raise RuntimeError(f"unregister_external_parameter: the parameter is not on {name}")
    del module._external_params[id(parameter)]
