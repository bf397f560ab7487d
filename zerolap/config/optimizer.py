"""The ``optimizer`` section: ``{"type": ..., "params": {...}}``, checked at load.

``type`` is matched without case against DeepSpeed's optimizer names, then against the
``torch.optim`` classes. DeepSpeed's ``Adam``, ``AdamW`` and ``Adagrad`` are built from
``torch.optim`` with DeepSpeed's semantics (see note [deepspeed adam]), its ``Lion`` from
``zerolap.ops.lion``; its other optimizers (Lamb, the 1-bit family, Muon, the muP ones) need
kernels or communication zerolap does not have and are errors. ``params`` are checked against
the arguments of the class that will be built, so a misspelt argument fails before training.

Note [deepspeed adam]: DeepSpeed's ``Adam`` is its FusedAdam with ``adam_w_mode`` true unless the
params say otherwise, so ``"type": "Adam"`` trains with decoupled weight decay (torch's AdamW);
``adam_w_mode: false`` gives torch's Adam. FusedAdam's ``weight_decay`` defaults to 0, torch
AdamW's to 0.01, so the DeepSpeed default is filled in. ``torch_adam`` (use torch's class) changes
nothing here, as zerolap always uses torch's classes, and ``bias_correction`` must stay true.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import torch
from pydantic import Field, field_validator

from zerolap.config.errors import AUTO_HINT, Problem, show
from zerolap.config.section import ConfigSection, DeepSpeedOnly, nearest_key
from zerolap.config.torch_names import init_arguments, torch_classes
from zerolap.ops.lion import FusedLion

__all__ = ["OptimizerConfig"]

_DEEPSPEED_BUILT = {"adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad", "lion": "Lion"}
_DEEPSPEED_NOT_BUILT = {
    name.lower(): name
    for name in (
        "Lamb",
        "OneBitAdam",
        "ZeroOneAdam",
        "OneBitLamb",
        "MuAdam",
        "MuAdamW",
        "MuSGD",
        "Muon",
    )
}
_ADAM_ONLY_PARAMS = ("adam_w_mode", "torch_adam", "bias_correction")


class OptimizerConfig(ConfigSection):
    """The ``optimizer`` section."""

    auto_means_default = False  # DeepSpeed passes these values on unchanged

    type: str
    """A DeepSpeed optimizer name (``Adam``, ``AdamW``, ``Adagrad``, ``Lion``) or a
    ``torch.optim`` class name (``SGD``, ...), in any case; stored in its canonical spelling."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the optimizer (``lr``, ``betas``, ``weight_decay``, ...)."""
    legacy_fusion: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed's legacy fused fp16 optimizer."""

    @field_validator("type")
    @classmethod
    def _known_type(cls, name: str) -> str:
        key = name.lower()
        if key in _DEEPSPEED_BUILT:
            return _DEEPSPEED_BUILT[key]
        torch_optimizers = torch_classes(torch.optim, torch.optim.Optimizer)
        if key in torch_optimizers and key not in _DEEPSPEED_NOT_BUILT:
            return torch_optimizers[key].__name__
        torch_names = [
            c.__name__ for k, c in torch_optimizers.items() if k not in _DEEPSPEED_NOT_BUILT
        ]
        allowed = sorted({*_DEEPSPEED_BUILT.values(), *torch_names})
        if key in _DEEPSPEED_NOT_BUILT:
            reason = f"{_DEEPSPEED_NOT_BUILT[key]} is a DeepSpeed optimizer zerolap cannot build"
        else:
            reason = "not a DeepSpeed or torch.optim optimizer"
        raise ValueError(f"{reason}; allowed (any case): {', '.join(allowed)}")

    @property
    def is_adam(self) -> bool:
        return self.type in ("Adam", "AdamW")

    def torch_optimizer(self) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        """The optimizer class to build and its keyword arguments (without ``params``), with
        DeepSpeed's semantics applied (note [deepspeed adam])."""
        kwargs = dict(self.params)
        if self.type == "Lion":
            return FusedLion, kwargs
        if not self.is_adam:
            return getattr(torch.optim, self.type), kwargs
        decoupled = self.type == "AdamW" or kwargs.get("adam_w_mode", True)
        if not kwargs.get("torch_adam", False):
            kwargs.setdefault("weight_decay", 0.0)
        for name in _ADAM_ONLY_PARAMS:
            kwargs.pop(name, None)
        return (torch.optim.AdamW if decoupled else torch.optim.Adam), kwargs

    def _check(self, context: Mapping[str, Any]) -> list[Problem]:
        optimizer_class = self.torch_optimizer()[0]
        arguments = init_arguments(optimizer_class, skip=("params",))
        if arguments is not None and self.is_adam:
            arguments += _ADAM_ONLY_PARAMS
        problems = [
            Problem((f"params.{key}",), message)
            for key, value in self.params.items()
            if (message := _param_problem(key, value, arguments, _qualified(optimizer_class)))
        ]
        if self.is_adam and self.params.get("bias_correction", True) is not True:
            message = (
                f"got {show(self.params['bias_correction'])}; torch's Adam always corrects bias"
            )
            problems.append(Problem(("params.bias_correction",), message))
        return problems


def _qualified(cls: type) -> str:
    """How an error names an optimizer class (``torch.optim.SGD``, ``deepspeed.ops.lion...``)."""
    if cls is FusedLion:
        return "deepspeed.ops.lion.FusedLion"
    return f"torch.optim.{cls.__name__}"


# Arguments whose values torch checks with a bare comparison or index: checked here first, so
# that a bad value is named by its key.
_NUMBERS = ("lr", "eps", "weight_decay", "momentum", "dampening", "alpha", "lr_decay")
_PAIRS = ("betas",)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _param_problem(key: str, value: Any, arguments: list[str] | None, class_name: str) -> str:
    """What is wrong with one optimizer argument, or "" when nothing is."""
    if isinstance(value, str) and value == "auto":
        return AUTO_HINT
    if key == "max_grad_norm":
        return "DeepSpeed ignores this optimizer argument; use the top-level gradient_clipping"
    if key in _NUMBERS and not _number(value):
        return f"must be a number, got {show(value)}"
    if key in _PAIRS and not (
        isinstance(value, list | tuple) and len(value) == 2 and all(map(_number, value))
    ):
        return f"must be two numbers, got {show(value)}"
    if arguments is None or key in arguments:
        return ""
    suggestion = nearest_key(key, arguments)
    hint = f"did you mean {suggestion}?" if suggestion else f"it takes {', '.join(arguments)}"
    return f"not an argument of {class_name}; {hint}"
