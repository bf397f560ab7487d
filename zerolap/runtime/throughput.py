"""``engine.tput_timer``: training throughput in samples per second, as DeepSpeed's
``ThroughputTimer`` reports it (DeepSpeed-Chat reads it at each epoch's end).

The engine starts it when a forward begins and stops it in ``step()``; the time in between (one
micro-step: forward, backward, and the optimizer at a boundary) is added up once ``start_step``
optimizer steps have passed, so the first steps (warm-up, allocation) are left out of the
average. Every ``steps_per_output`` optimizer steps, rank 0 logs the running and the current
rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from zerolap.accelerator import get_accelerator
from zerolap.config.timers import ThroughputTimerConfig
from zerolap.utils.logging import logger

__all__ = ["ThroughputTimer"]

_GIB = 1024**3


class ThroughputTimer:
    def __init__(
        self,
        config: ThroughputTimerConfig,
        batch_size: int | None,
        start_step: int = 2,
        steps_per_output: int | None = None,
        monitor_memory: bool = False,
        logging_fn: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn or logger.info
        self.started = False
        self.start_time = 0.0
        self.end_time = 0.0
        self.epoch_count = 0
        self.micro_step_count = 0  # within the epoch
        self.global_step_count = 0
        self.total_elapsed_time = 0.0  # over the timed optimizer steps
        self.step_elapsed_time = 0.0  # over the current optimizer step's micro-steps

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def _sync(self) -> None:
        if self.config.synchronized:
            get_accelerator().synchronize()

    def start(self) -> None:
        if not self.config.enabled:
            return
        self.started = True
        if self.global_step_count >= self.start_step:
            self._sync()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End a micro-step; ``global_step`` when it ended an optimizer step."""
        if not self.config.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time <= 0:  # still inside the first start_step steps
            return
        self._sync()
        self.end_time = time.time()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if not global_step:
            return
        if report_speed and self._reports_now():
            self.logging(self._report())
        self.step_elapsed_time = 0.0

    def _reports_now(self) -> bool:
        return bool(self.steps_per_output) and self.global_step_count % self.steps_per_output == 0

    def _report(self) -> str:
        accelerator = get_accelerator()
        current = self.batch_size / max(self.step_elapsed_time, 1e-12)
        line = (
            f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
            f"global_step={self.global_step_count}, "
            f"RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
            f"CurrSamplesPerSec={current}, "
            f"MemAllocated={round(accelerator.memory_allocated() / _GIB, 2)}GB, "
            f"MaxMemAllocated={round(accelerator.max_memory_allocated() / _GIB, 2)}GB"
        )
        if self.monitor_memory:
            import psutil

            line += (
                f", vm %: {psutil.virtual_memory().percent}, swap %: {psutil.swap_memory().percent}"
            )
        return line

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed optimizer steps; -inf before any was timed."""
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed_steps)
