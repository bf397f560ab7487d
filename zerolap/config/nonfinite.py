"""``nonfinite_gradients`` (zerolap's own section): what a step whose gradients hold inf or nan
does. fp16's dynamic loss scaling keeps DeepSpeed's behaviour (shrink the scale, skip the step);
everywhere else (fp32, bf16, fp16 with a static scale) the step is skipped on every rank and
counted, with a warning naming the step and the rank the non-finite values came from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from zerolap.config.section import ConfigSection

__all__ = ["NonFiniteConfig"]


class NonFiniteConfig(ConfigSection):
    """The ``nonfinite_gradients`` section."""

    action: Literal["skip", "raise"] = "skip"
    """``skip``: skip the step on every rank, count it (``engine.skipped_steps``) and warn;
    ``raise``: a ``NonFiniteGradientError`` on every rank instead."""
    max_consecutive_skips: int = Field(10, ge=1)
    """So many skipped steps in a row are a ``NonFiniteGradientError``: a run that keeps
    producing inf or nan is not training."""
