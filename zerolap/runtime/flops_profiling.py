"""ds_config's ``flops_profiler`` in the engine: when rank 0 profiles, and what it prints.

DeepSpeed counts and times the same forward, so the counting's own cost lands in its
latencies. Here the two are apart, each on real training forwards:

1. Step ``profile_step`` (or the first step after it that trains, in a run resumed past it):
   each training forward is timed module by module, the hooks on only while the engine's
   forward runs (a recompute in the backward is the backward's), and the engine's phases give
   the step's backward and optimizer times. Nothing is counted.
2. The next training forward is counted (``zerolap.profiling.flops``), and the profile is
   printed when it ends: summary, aggregated view, module tree.

Evaluation forwards (gradients off) are neither timed nor counted: they are not micro-batches,
and their batches may have other shapes. A run that stops before step 2 prints nothing.
"""

from __future__ import annotations

import enum
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from zerolap.config.flops_profiler import FlopsProfilerConfig
from zerolap.profiling.flops import (
    ModelProfile,
    StepTimes,
    model_report,
    recording,
    write_report,
)
from zerolap.utils.logging import logger

__all__ = ["StepFlopsProfile"]


class _Stage(enum.Enum):
    WAITING = "waiting"  # before step profile_step
    TIMING = "timing"  # during it
    COUNTING = "counting"  # the next forward is counted, then the profile printed
    DONE = "done"


class StepFlopsProfile:
    """Rank 0's profile of ``model``; an engine phase recorder (``engine.add_phase_recorder``)
    told of each forward by ``before_forward`` / ``after_forward``. ``describe()`` gives the
    job's sizes (``StepTimes``' fields but the times) when the profile is printed."""

    def __init__(
        self,
        model: torch.nn.Module,
        section: FlopsProfilerConfig,
        describe: Callable[[], dict],
    ) -> None:
        self.model = model
        self.section = section
        self.describe = describe
        self.stage = _Stage.WAITING
        self.timed = ModelProfile(model)
        self.counted = ModelProfile(model)
        self._phases: dict[str, float] = defaultdict(float)
        self._forward_time = 0.0
        self._forwards = 0
        self._recording = None
        self._started = 0.0
        self._step = section.profile_step  # the step timed

    # -- the engine's calls -----------------------------------------------------------------

    def before_forward(self, global_steps: int) -> None:
        """A forward of the engine begins. Only training forwards (gradients on) are timed or
        counted: an evaluation inside the step is neither a micro-batch nor its shape."""
        if not torch.is_grad_enabled():
            return
        if self.stage is _Stage.WAITING and global_steps >= self.section.profile_step:
            self.stage = _Stage.TIMING
            self._step = global_steps
        if self.stage is _Stage.TIMING:
            self._start(count=False, profile=self.timed)
            self._started = time.perf_counter()
        elif self.stage is _Stage.COUNTING:
            self._start(count=True, profile=self.counted)

    def after_forward(self) -> None:
        if self._recording is None:
            return
        self._stop()  # hooks only around the engine's forwards (not a recompute in backward)
        if self.stage is _Stage.TIMING:
            self._forward_time += time.perf_counter() - self._started
            self._forwards += 1
        elif self.stage is _Stage.COUNTING:
            self.stage = _Stage.DONE
            self._print()

    def abandon(self) -> None:
        """The forward raised: its hooks come off, and it is neither timed nor counted."""
        self._stop()

    def record(self, phase: str, start: float, end: float, compute: bool = True) -> None:
        if self.stage is not _Stage.TIMING or phase == "forward":
            return  # forwards are timed above, training ones only
        if phase != "step_end":
            self._phases[phase] += end - start
        elif self._forwards:
            self.timed.timed_passes = self._forwards
            self.stage = _Stage.COUNTING

    def close(self) -> None:
        self._stop()
        self.stage = _Stage.DONE

    # -- inside -----------------------------------------------------------------------------

    def _start(self, *, count: bool, profile: ModelProfile) -> None:
        self._recording = recording(self.model, profile, count=count, timed=not count)
        self._recording.__enter__()

    def _stop(self) -> None:
        if self._recording is not None:
            self._recording.__exit__(None, None, None)
            self._recording = None

    def _print(self) -> None:
        phases, forwards = self._phases, self._forwards
        times = StepTimes(
            forward=self._forward_time / forwards,
            backward=(phases["backward"] + phases["backward_wait"]) / forwards,
            step=phases["optimizer"] + phases["allgather_wait"],
            micro_batches=forwards,
            **self.describe(),
        )
        self.timed.own_flops = self.counted.own_flops
        text = model_report(
            self.timed,
            profile_step=self._step,
            module_depth=self.section.module_depth,
            top_modules=self.section.top_modules,
            detailed=self.section.detailed,
            times=times,
            recompute_fwd_factor=self.section.recompute_fwd_factor,
        )
        try:
            write_report(text, self.section.output_file)
        except OSError as error:  # inside a forward on rank 0 alone: say so, train on
            logger.error(f"flops_profiler: the profile could not be written: {error}")
