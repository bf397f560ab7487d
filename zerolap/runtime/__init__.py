"""The engine's single-process parts: optimizer, learning-rate schedule, loss scaling."""

from zerolap.runtime.loss_scaler import DynamicLossScaler, LossScaler, build_loss_scaler
from zerolap.runtime.lr_schedules import (
    LRRangeTest,
    OneCycle,
    Scheduler,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)
from zerolap.runtime.nonfinite import NonFiniteGradientError
from zerolap.runtime.optimizers import build_optimizer

__all__ = [
    "DynamicLossScaler",
    "LRRangeTest",
    "LossScaler",
    "NonFiniteGradientError",
    "OneCycle",
    "Scheduler",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_loss_scaler",
    "build_optimizer",
    "build_scheduler",
]
