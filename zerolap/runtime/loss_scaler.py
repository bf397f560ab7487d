"""Loss scales for fp16 training: fixed, or dynamic with DeepSpeed's update rule.

The engine multiplies the loss by ``loss_scale``, checks the reduced gradients for inf/nan
itself, skips the step on overflow, and reports every step to ``update_scale(overflow)``.

Dynamic rule (DeepSpeed's ``DynamicLossScaler.update_scale``), per update:

* Overflow: if the hysteresis counter is down to 1 (or ``delayed_shift`` is 1) divide the scale
  by ``scale_factor``, never below ``min_scale``, and raise if it already was at ``min_scale``
  (DeepSpeed ends the run there; ``raise_error_at_min_scale=False`` keeps going). Otherwise only
  decrement the counter. Shrinking does not refill the counter, so once it reaches 1 every
  further overflow shrinks until something refills it.
* No overflow: with ``consecutive_hysteresis`` refill the counter. Then grow the scale by
  ``scale_factor`` when the number of updates since the last overflow, not counting the first,
  is a positive multiple of ``scale_window`` (refilling the counter here when not
  ``consecutive_hysteresis``). At the start the "last overflow" is update -1, so the first
  growth comes after ``scale_window + 1`` clean updates, later ones every ``scale_window``.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

__all__ = ["DynamicLossScaler", "LossScaler", "build_loss_scaler"]


class LossScaler:
    """A fixed loss scale: ``fp16.loss_scale`` > 0, or 1 when fp16 is off."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        _check_positive_finite(scale, "scale")
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        """A fixed scale ignores overflow; the engine still skips the step."""

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.cur_scale = state_dict["cur_scale"]


class DynamicLossScaler(LossScaler):
    """A loss scale that shrinks on overflow and grows after ``scale_window`` clean updates.

    ``delayed_shift`` is ds_config's ``hysteresis``: how many overflows it takes to shrink.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
        *,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        super().__init__(init_scale)
        _check_positive_finite(min_scale, "min_scale")
        _check_positive_int(scale_window, "scale_window")
        _check_positive_int(delayed_shift, "delayed_shift")
        if not scale_factor > 1:
            raise ValueError(f"scale_factor must be greater than 1, got {scale_factor!r}")
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        # Number of update_scale() calls so far.
        self.cur_iter = 0
        # cur_iter of the latest overflow; -1 before any.
        self.last_overflow_iter = -1
        # Overflows still tolerated before the next shrink, counting the one that shrinks.
        self.cur_hysteresis = delayed_shift

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self._on_overflow()
        else:
            self._on_clean_step()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.delayed_shift == 1 or self.cur_hysteresis == 1:
            if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                raise RuntimeError(
                    f"gradient overflow with the loss scale already at its minimum "
                    f"{self.min_scale} (fp16.min_loss_scale): cannot decrease it further"
                )
            self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
        else:
            self.cur_hysteresis -= 1
        self.last_overflow_iter = self.cur_iter

    def _on_clean_step(self) -> None:
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.delayed_shift
        stable_updates = self.cur_iter - self.last_overflow_iter - 1
        if stable_updates > 0 and stable_updates % self.scale_window == 0:
            if not self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= self.scale_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.cur_scale = state_dict["cur_scale"]
        self.cur_iter = state_dict["cur_iter"]
        self.last_overflow_iter = state_dict["last_overflow_iter"]
        self.cur_hysteresis = state_dict["cur_hysteresis"]


class Fp16Section(Protocol):
    """The fields of ds_config's ``fp16`` section that the scaler reads."""

    enabled: bool
    loss_scale: float
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_loss_scale: float


def build_loss_scaler(fp16: Fp16Section) -> LossScaler:
    """The scaler for an ``fp16`` section: dynamic when ``loss_scale`` is 0, fixed otherwise,
    and a fixed scale of 1 when fp16 is disabled (bf16 and fp32 need no scaling)."""
    if not fp16.enabled:
        return LossScaler(1.0)
    if fp16.loss_scale != 0:
        return LossScaler(fp16.loss_scale)
    return DynamicLossScaler(
        init_scale=2**fp16.initial_scale_power,
        scale_window=fp16.loss_scale_window,
        min_scale=fp16.min_loss_scale,
        delayed_shift=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
    )


def _check_positive_finite(value: float, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")


def _check_positive_int(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
