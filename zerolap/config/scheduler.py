"""The ``scheduler`` section: ``{"type": ..., "params": {...}}``, checked at load.

``type`` is matched without case against DeepSpeed's schedules, then against the
``torch.optim.lr_scheduler`` classes (DeepSpeed falls back to those too). All five of
DeepSpeed's (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``, ``LRRangeTest``)
are built by zerolap (``runtime.lr_schedules``). ``params`` are checked against the schedule's
arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pydantic import Field, field_validator

from zerolap.config.errors import AUTO_HINT, Problem
from zerolap.config.section import ConfigSection, nearest_key
from zerolap.config.torch_names import init_arguments, torch_classes

__all__ = ["DEEPSPEED_SCHEDULES", "SchedulerConfig"]

_WARMUP = (
    "warmup_min_lr",
    "warmup_max_lr",
    "warmup_num_steps",
    "warmup_type",
    "last_batch_iteration",
)
_COSINE = (
    "total_num_steps",
    "warmup_min_ratio",
    "warmup_num_steps",
    "cos_min_ratio",
    "warmup_type",
    "last_batch_iteration",
)
DEEPSPEED_SCHEDULES: dict[str, tuple[str, ...]] = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": ("total_num_steps", *_WARMUP),
    "WarmupCosineLR": _COSINE,
    "OneCycle": (
        "cycle_min_lr",
        "cycle_max_lr",
        "decay_lr_rate",
        "cycle_first_step_size",
        "cycle_second_step_size",
        "cycle_first_stair_count",
        "cycle_second_stair_count",
        "decay_step_size",
        "cycle_momentum",
        "cycle_min_mom",
        "cycle_max_mom",
        "decay_mom_rate",
        "last_batch_iteration",
    ),
    "LRRangeTest": (
        "lr_range_test_min_lr",
        "lr_range_test_step_size",
        "lr_range_test_step_rate",
        "lr_range_test_staircase",
        "last_batch_iteration",
    ),
}
"""DeepSpeed's schedules that zerolap builds -> the arguments each takes."""
_REQUIRED = {
    "WarmupDecayLR": ("total_num_steps",),
    "WarmupCosineLR": ("total_num_steps",),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
}
_WARMUP_TYPES = ("log", "linear")


def _torch_schedulers() -> dict[str, type]:
    return torch_classes(torch.optim.lr_scheduler, torch.optim.lr_scheduler.LRScheduler)


class SchedulerConfig(ConfigSection):
    """The ``scheduler`` section."""

    auto_means_default = False  # DeepSpeed passes these values on unchanged

    type: str
    """A DeepSpeed schedule (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``,
    ``OneCycle``, ``LRRangeTest``) or a
    ``torch.optim.lr_scheduler`` class name, in any case; stored in its canonical spelling."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the schedule (``warmup_num_steps``, ``total_num_steps``, ...)."""

    @field_validator("type")
    @classmethod
    def _known_type(cls, name: str) -> str:
        key = name.lower()
        deepspeed = {schedule.lower(): schedule for schedule in DEEPSPEED_SCHEDULES}
        if key in deepspeed:
            return deepspeed[key]
        torch_schedulers = _torch_schedulers()
        if key in torch_schedulers:
            return torch_schedulers[key].__name__
        allowed = [*DEEPSPEED_SCHEDULES, *(c.__name__ for c in torch_schedulers.values())]
        raise ValueError(
            f"not a DeepSpeed or torch schedule; allowed (any case): {', '.join(allowed)}"
        )

    @property
    def torch_class(self) -> type | None:
        """The ``torch.optim.lr_scheduler`` class to build; None for DeepSpeed's schedules."""
        if self.type in DEEPSPEED_SCHEDULES:
            return None
        return getattr(torch.optim.lr_scheduler, self.type)

    def _check(self, context: Mapping[str, Any]) -> list[Problem]:
        torch_class = self.torch_class
        if torch_class is None:
            arguments: list[str] | None = list(DEEPSPEED_SCHEDULES[self.type])
        else:
            arguments = init_arguments(torch_class, skip=("optimizer",))
        problems = []
        for key, value in self.params.items():
            if isinstance(value, str) and value == "auto":
                problems.append(Problem((f"params.{key}",), AUTO_HINT))
            elif arguments is not None and key not in arguments:
                suggestion = nearest_key(key, arguments)
                hint = (
                    f"did you mean {suggestion}?"
                    if suggestion
                    else f"it takes {', '.join(arguments)}"
                )
                problems.append(
                    Problem((f"params.{key}",), f"not an argument of {self.type}; {hint}")
                )
        for key in _REQUIRED.get(self.type, ()):
            if key not in self.params:
                problems.append(Problem((f"params.{key}",), f"{self.type} needs this argument"))
        warmup_type = self.params.get("warmup_type", "log")
        if torch_class is None and warmup_type not in _WARMUP_TYPES:
            message = f"got {warmup_type!r}; must be one of {', '.join(_WARMUP_TYPES)}"
            problems.append(Problem(("params.warmup_type",), message))
        return problems
