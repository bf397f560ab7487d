"""The ``timers`` section: the engine's throughput timer (``engine.tput_timer``)."""

from __future__ import annotations

from pydantic import Field

from zerolap.config.section import ConfigSection

__all__ = ["ThroughputTimerConfig", "TimersConfig"]


class ThroughputTimerConfig(ConfigSection):
    """``timers.throughput``."""

    enabled: bool = True
    """Time every micro-step from forward to ``step()`` and log samples per second every
    ``steps_per_print`` optimizer steps."""
    synchronized: bool = True
    """Wait for the accelerator's queued work at both ends of each timing (a no-op on CPU), so
    the time covers the work and not only its launch."""


class TimersConfig(ConfigSection):
    """The ``timers`` section."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)
