"""DeepSpeed's learning-rate schedules, with its parameter names, defaults and formulas.

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

Without warmup:

* ``LRRangeTest``: min_lr * (1 + step_rate * n), with n = (i + 1) / step_size, or its floor with
  ``lr_range_test_staircase``.
* ``OneCycle``: with S1 and S2 the two half-cycles' lengths and c = i + 1, the scale s rises
  from 0 to 1 over the first half (c / S1 of it) and falls back over the second; the lr is
  min + (max - min) s and, with ``cycle_momentum``, beta1 is max_mom - (max_mom - min_mom) s. A
  stair count k holds s at floor(k x the half's fraction) / k. After the cycle (i >= S1 + S2),
  with ``decay_step_size`` d > 0 and j = i - S1 - S2 + 1 batches into the decay, the lr is
  min / (1 + decay_lr_rate j / d) and beta1 max_mom (1 + decay_mom_rate j / d); with d = 0 (or a
  zero rate) they hold at min and max_mom. Iteration -1 sets cycle_min_lr and cycle_min_mom, as
  DeepSpeed does. Unlike DeepSpeed, beta2 stays the optimizer's own: DeepSpeed sets it to 0.99
  in every group while it cycles beta1, which no key asks for.
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
    "LRRangeTest",
    "OneCycle",
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


class _Schedule:
    """Step bookkeeping shared by the schedules; a subclass computes ``get_lr()`` and calls this
    constructor last, once the fields ``get_lr()`` reads are set."""

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        # Index of the last finished batch, -1 before training: the only checkpointed state.
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply()

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply(self) -> list[float]:
        """The groups' lrs (and what else the schedule sets) for ``last_batch_iteration``."""
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


class _WarmupSchedule(_Schedule):
    """A schedule that warms up over ``warmup_num_steps`` (``log`` or ``linear``)."""

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_num_steps: int,
        warmup_type: str,
        last_batch_iteration: int,
    ) -> None:
        _check_steps(warmup_num_steps, "warmup_num_steps")
        if warmup_type not in WARMUP_TYPES:
            # DeepSpeed warns and falls back to "log"; a typo here should not silently do that.
            raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")
        # DeepSpeed raises 1 to 2 because log(1) = 0 would divide by zero in the log warmup.
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def _warmup_fraction(self) -> float:
        """How far through the warmup iteration ``last_batch_iteration`` (< W) is, in [0, 1)."""
        if self.warmup_type == "log":
            # Multiplied by the reciprocal, as DeepSpeed does, to agree to the last bit.
            return math.log(self.last_batch_iteration + 1) * (1.0 / math.log(self.warmup_num_steps))
        return self.last_batch_iteration / self.warmup_num_steps


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


class LRRangeTest(_Schedule):
    """Raise each group's lr from ``lr_range_test_min_lr`` by ``lr_range_test_step_rate`` times
    it every ``lr_range_test_step_size`` batches, continuously or (``lr_range_test_staircase``)
    in stairs: the range test that finds the largest lr a model trains at."""

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        _check_steps(lr_range_test_step_size, "lr_range_test_step_size")
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration)

    def step(self, batch_iteration: int | None = None) -> None:
        """Move to the next batch (or to ``batch_iteration``: DeepSpeed's name here)."""
        super().step(batch_iteration)

    def get_lr(self) -> list[float]:
        intervals = float(self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            intervals = math.floor(intervals)
        increase = 1 + self.step_rate * intervals
        return [low * increase for low in self.min_lrs]


class OneCycle(_Schedule):
    """One cycle of the lr from ``cycle_min_lr`` up to ``cycle_max_lr`` and back (over
    ``cycle_first_step_size`` then ``cycle_second_step_size`` batches, optionally in stairs),
    with beta1 cycled the other way between ``cycle_max_mom`` and ``cycle_min_mom``, then an
    optional decay every ``decay_step_size`` batches (the module's docstring has the formulas)."""

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | list[float] = 0.8,
        cycle_max_mom: float | list[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        if cycle_second_step_size is None:
            cycle_second_step_size = cycle_first_step_size
        if cycle_second_stair_count is None:
            cycle_second_stair_count = cycle_first_stair_count
        _check_steps(cycle_first_step_size, "cycle_first_step_size", integer=False)
        for name, count in [
            ("cycle_second_step_size", cycle_second_step_size),  # 0: the lr rises only
            ("cycle_first_stair_count", cycle_first_stair_count),
            ("cycle_second_stair_count", cycle_second_stair_count),
            ("decay_step_size", decay_step_size),
        ]:
            if isinstance(count, bool) or not isinstance(count, (int, float)) or count < 0:
                raise ValueError(f"{name} must be a number >= 0, got {count!r}")
        self.first_size = float(cycle_first_step_size)
        self.second_size = float(cycle_second_step_size)
        self.total_size = self.first_size + self.second_size
        self.stairs = (cycle_first_stair_count, cycle_second_stair_count)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        # A zero interval or rate holds the lr (momentum) where the cycle ended.
        decays = not math.isclose(decay_step_size, 0)
        self.decay_step_size = decay_step_size
        self.decay_lr_rate = decay_lr_rate if decays else 0.0
        self.decay_mom_rate = decay_mom_rate if decays else 0.0
        if cycle_momentum and "betas" not in optimizer.defaults:
            logger.warning(
                f"OneCycle: cycle_momentum is off, since {type(optimizer).__name__} has no betas "
                "to cycle"
            )
            cycle_momentum = False
        self.cycle_momentum = cycle_momentum
        kept = {group["betas"][1] for group in optimizer.param_groups} if cycle_momentum else set()
        if kept - {0.99}:
            logger.warning(
                f"OneCycle: beta2 stays the optimizer's ({', '.join(map(str, sorted(kept)))}); "
                "DeepSpeed's OneCycle sets it to 0.99 in every group"
            )
        super().__init__(optimizer, last_batch_iteration)

    def step(self, batch_iteration: int | None = None) -> None:
        """Move to the next batch (or to ``batch_iteration``: DeepSpeed's name here)."""
        super().step(batch_iteration)

    def _scale(self) -> float:
        """Where the cycle is for the next batch: 0 at the ends, 1 at the peak."""
        batch = self.last_batch_iteration + 1
        # DeepSpeed's arithmetic, so that both give the same lrs to the last bit.
        ratio = self.first_size / self.total_size
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        rising = x <= ratio
        scale = x / ratio if rising else (x - 1) / (ratio - 1)
        stairs = self.stairs[0] if rising else self.stairs[1]
        if stairs > 0:
            # Counted from the batch's place in its half, not from the scale: a scale a hair
            # under 1 at the peak would floor a whole stair down.
            place = batch % self.total_size
            if place <= self.first_size:
                position = place * stairs / self.first_size
            else:
                position = (self.total_size - place) * stairs / self.second_size
            scale = math.floor(position) / stairs
        return scale

    def _decayed(self) -> float:
        """Decay intervals passed since the cycle ended."""
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [
                lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)
            ]
        if not self.decay_lr_rate:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decayed()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[float] | None:
        """Each group's beta1 for ``last_batch_iteration`` (None without ``cycle_momentum``)."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration == -1:
            return list(self.min_moms)  # DeepSpeed's start, whatever the cycle says
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [
                hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms, strict=True)
            ]
        if not self.decay_mom_rate:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decayed()
        return [hi * factor for hi in self.max_moms]

    def _apply(self) -> list[float]:
        lrs = super()._apply()
        if self.cycle_momentum:
            for group, beta1 in zip(self.optimizer.param_groups, self.get_mom(), strict=True):
                group["betas"] = (beta1, *tuple(group["betas"])[1:])
        return lrs


def _check_steps(value, name: str, *, integer: bool = True) -> None:
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


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


VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
"""DeepSpeed's own schedules, all implemented here (Accelerate checks a scheduler's class name
against this list to tell DeepSpeed's schedules from torch's)."""

# Ours, then torch's that are built from keyword parameters alone (LambdaLR and friends need
# callables, ReduceLROnPlateau a metric in step()): DeepSpeed too falls back to torch's names.

_SCHEDULERS: dict[str, type] = {
    cls.__name__.lower(): cls
    for cls in [LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR]
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
