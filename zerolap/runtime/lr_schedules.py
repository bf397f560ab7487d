"""DeepSpeed's warmup learning-rate schedules, with its parameter names, defaults and formulas.

Counting follows DeepSpeed, not ``torch.optim.lr_scheduler``: ``last_batch_iteration`` is the
index of the last finished batch, -1 before training, and the constructor sets the lr for
iteration -1 without stepping. So the first optimizer step runs at the iteration -1 lr
(``warmup_min_lr``; 0 for ``WarmupCosineLR``) and the first ``step()`` moves to iteration 0,
which is why these are not ``LRScheduler`` subclasses (whose constructor steps once).

With W = max(2, warmup_num_steps), T = total_num_steps and i = last_batch_iteration, the warmup
fraction for i < W is log(i + 1) / log(W) ("log") or i / W ("linear"), and afterwards:

* ``WarmupLR``: 1.
* ``WarmupDecayLR``: max(0, (T - i) / max(1, T - W)), linear decay back to ``warmup_min_lr``.
* ``WarmupCosineLR`` scales each group's initial lr by a ratio: warmup_min_ratio plus the warmup
  fraction of the rest, then cos_min_ratio + (1 - cos_min_ratio)(1 + cos(pi p)) / 2 with
  p = min(1, (i - W + 1) / max(1, T - W)).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch.optim import Optimizer

from zerolap.runtime.optimizers import reject_unknown_params
from zerolap.utils.logging import logger

__all__ = [
    "VALID_LR_SCHEDULES",
    "Scheduler",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
]

WARMUP_TYPES = ("log", "linear")
# torch.optim.lr_scheduler classes offered beside ours, by name.
_TORCH_SCHEDULERS = [
    "StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR", "PolynomialLR",
    "CosineAnnealingLR", "CosineAnnealingWarmRestarts", "CyclicLR", "OneCycleLR",
]  # fmt: skip


class Scheduler(Protocol):
    """What the engine needs of a schedule: ours and torch's both satisfy it."""

    def step(self) -> None: ...
    def get_last_lr(self) -> list[float]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class _WarmupSchedule:
    """Step bookkeeping shared by the schedules; a subclass computes ``get_lr()`` and calls this
    constructor last, once the fields ``get_lr()`` reads are set."""

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_num_steps: int,
        warmup_type: str,
        last_batch_iteration: int,
    ) -> None:
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int):
            raise ValueError(f"warmup_num_steps must be an integer, got {warmup_num_steps!r}")
        if warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be positive, got {warmup_num_steps}")
        if warmup_type not in WARMUP_TYPES:
            # DeepSpeed warns and falls back to "log"; a typo here should not silently do that.
            raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")
        self.optimizer = optimizer
        # DeepSpeed raises 1 to 2 because log(1) = 0 would divide by zero in the log warmup.
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        # Index of the last finished batch, -1 before training: the only checkpointed state.
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply()

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _warmup_fraction(self) -> float:
        """How far through the warmup iteration ``last_batch_iteration`` (< W) is, in [0, 1)."""
        if self.warmup_type == "log":
            # Multiplied by the reciprocal, as DeepSpeed does, to agree to the last bit.
            return math.log(self.last_batch_iteration + 1) * (1.0 / math.log(self.warmup_num_steps))
        return self.last_batch_iteration / self.warmup_num_steps

    def _apply(self) -> list[float]:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        return lrs

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Move to the next batch (or to ``last_batch_iteration``) and set the groups' lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply()

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Unlike DeepSpeed, also re-apply the lrs, so that the optimizer agrees with the schedule
        # whichever of the two is restored first.
        self.last_batch_iteration = state_dict["last_batch_iteration"]
        self._last_lr = self._apply()


class WarmupLR(_WarmupSchedule):
    """Warm up each group from ``warmup_min_lr`` to ``warmup_max_lr`` (each a float or one per
    group; ``warmup_max_lr=None`` takes each group's current lr), then hold."""

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if warmup_max_lr is None:
            max_lrs = [group["lr"] for group in optimizer.param_groups]
        else:
            max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.delta_lrs = [big - small for big, small in zip(max_lrs, self.min_lrs, strict=True)]
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [
            low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs, strict=True)
        ]

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        return 1.0


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``, then linear decay back to ``warmup_min_lr`` at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = 0.001,  # DeepSpeed's default, unlike WarmupLR
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )
        _warn_if_no_decay(total_num_steps, self.warmup_num_steps)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        decay_steps = max(1.0, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - self.last_batch_iteration) / decay_steps)


class WarmupCosineLR(_WarmupSchedule):
    """Scale each group's initial lr: warm up from ``warmup_min_ratio`` to 1, then cosine-decay
    to ``cos_min_ratio`` at ``total_num_steps`` and hold there."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        # The peak lrs, read before the constructor overwrites the groups' lrs.
        self.org_lrs = [group["lr"] for group in optimizer.param_groups]
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        _warn_if_no_decay(total_num_steps, self.warmup_num_steps)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            # DeepSpeed's value before the first step() is 0, whatever warmup_min_ratio is.
            return [0.0 for _ in self.org_lrs]
        ratio = self._ratio()
        return [lr * ratio for lr in self.org_lrs]

    def _ratio(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            fraction = self._warmup_fraction()
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        steps_done = self.last_batch_iteration - self.warmup_num_steps + 1
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, steps_done / decay_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)


def _per_group(optimizer: Optimizer, value: float | list[float], name: str) -> list[float]:
    count = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} values for {count} param groups")
        return list(value)
    return [value] * count


def _warn_if_no_decay(total_num_steps: int, warmup_num_steps: int) -> None:
    if total_num_steps < warmup_num_steps:
        logger.warning(
            f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}"
        )


VALID_LR_SCHEDULES = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
"""DeepSpeed's own schedules that zerolap implements (Accelerate checks a scheduler's class name
against this list to tell DeepSpeed's schedules from torch's)."""

# Ours, then torch's that are built from keyword parameters alone (LambdaLR and friends need
# callables, ReduceLROnPlateau a metric in step()): DeepSpeed too falls back to torch's names.

_SCHEDULERS: dict[str, type] = {
    cls.__name__.lower(): cls
    for cls in [WarmupLR, WarmupDecayLR, WarmupCosineLR]
    + [getattr(torch.optim.lr_scheduler, name) for name in _TORCH_SCHEDULERS]
}


def build_scheduler(
    type_name: str, params: dict[str, Any] | None, optimizer: Optimizer
) -> Scheduler:
    """Build the schedule for ``scheduler.type`` / ``scheduler.params`` (names match in any
    case). ``optimizer`` is the one whose param groups' lrs it sets."""
    cls = _SCHEDULERS.get(type_name.lower())
    if cls is None:
        allowed = ", ".join(known.__name__ for known in _SCHEDULERS.values())
        raise ValueError(
            f"scheduler.type {type_name!r} is not a known schedule; allowed (any case): {allowed}"
        )
    kwargs = dict(params or {})
    reject_unknown_params(cls, kwargs, section="scheduler.params")
    try:
        return cls(optimizer, **kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"scheduler.params for {type_name!r}: {err}") from err
