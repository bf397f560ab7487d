"""The events the engine writes to its monitors (ds_config's ``tensorboard``, ``csv_monitor``,
``wandb`` and ``comet`` blocks), and when.

Once per optimizer step, on global rank 0, each at the global sample count after the step
(DeepSpeed's x-axis, ``engine.global_samples``, restored with a checkpoint):

* ``Train/Samples/train_loss``: the mean of the losses handed to ``engine.backward()`` since
  the last step, rank 0's own, as given (before the division by the accumulation steps).
  DeepSpeed 0.19.8 writes it from its pipeline engine only (older releases wrote it from
  ``backward()`` too); a step whose backwards did not go through ``engine.backward()`` (a
  plain ``loss.backward()``) has none.
* ``Train/Samples/lr``: the first parameter group's learning rate after the step.
* ``Train/Samples/loss_scale``: with fp16, the loss scale after the step.
* With ``wall_clock_breakdown``: ``Train/Samples/elapsed_time_ms_<timer>`` for DeepSpeed's
  forward, backward, backward_inner, backward_allreduce and step timers, each the step's total
  over its micro-batches in milliseconds (``runtime.timers.TIMED`` says which phases each sums).

The pipeline engine writes ``train_batch()``'s loss as ``train_loss`` and ``eval_batch()``'s as
``Train/Samples/eval_loss``. A step whose update was skipped (a non-finite gradient) still
writes its events, as DeepSpeed's does.
"""

from __future__ import annotations

from collections import defaultdict

import torch

import zerolap.comm as dist
from zerolap.config.errors import ConfigError
from zerolap.monitor import MonitorError, MonitorMaster
from zerolap.runtime.timers import TIMED

__all__ = ["TrainingEvents", "start_monitors"]

_PREFIX = "Train/Samples/"


class TrainingEvents:
    """Rank 0's events for ``monitor``; with ``timed`` it is also a phase recorder of the
    engine (``engine.add_phase_recorder``), summing each step's phases."""

    def __init__(self, monitor: MonitorMaster, *, timed: bool) -> None:
        self.monitor = monitor
        self.timed = timed
        self._phases: dict[str, float] = defaultdict(float)  # the step under way's
        self._last_step: dict[str, float] = {}  # the step that just ended's
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0

    def record(self, phase: str, start: float, end: float, compute: bool = True) -> None:
        if phase == "step_end":
            self._last_step, self._phases = self._phases, defaultdict(float)
        else:
            self._phases[phase] += end - start

    def observe_loss(self, loss: torch.Tensor) -> None:
        """A loss handed to ``backward()``; kept on its device (read once per step)."""
        value = loss.detach().float().mean()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def step(self, *, samples: int, lr: float, loss_scale: float | None) -> None:
        """The events of the optimizer step that brought the run to ``samples``."""
        events = []
        if self._loss_count:
            mean = (self._loss_sum / self._loss_count).item()
            events.append((_PREFIX + "train_loss", mean, samples))
            self._loss_sum, self._loss_count = None, 0
        events.append((_PREFIX + "lr", lr, samples))
        if loss_scale is not None:
            events.append((_PREFIX + "loss_scale", loss_scale, samples))
        if self.timed:
            for _, timer, phases in TIMED:
                elapsed = sum(self._last_step.get(phase, 0.0) for phase in phases) * 1e3
                events.append((f"{_PREFIX}elapsed_time_ms_{timer}", elapsed, samples))
        self.monitor.write_events(events)

    def write(self, name: str, value: float, samples: int) -> None:
        """One event outside the step's (the pipeline engine's losses)."""
        self.monitor.write_events([(_PREFIX + name, value, samples)])


def start_monitors(config) -> MonitorMaster:
    """The engine's ``MonitorMaster``. A writer that cannot start on rank 0 (an output path
    that is a file, a W&B run that cannot begin) fails ``initialize`` on every rank alike: one
    one-element all-reduce, only when a monitor is switched on."""
    monitor, failure = None, None
    try:
        monitor = MonitorMaster(config)  # a missing package: a ConfigError on every rank
    except MonitorError as error:
        failure = error
    if monitor is not None and not monitor.enabled:
        return monitor
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([0.0 if failure is None else 1.0], device=dist.buffer_device())
        dist.all_reduce(flag, op="max")
        if flag.item() and failure is None:
            raise ConfigError("a monitor could not start on rank 0 (its error names it)")
    if failure is not None:
        raise ConfigError(f"a monitor could not start: {failure}") from failure
    return monitor
