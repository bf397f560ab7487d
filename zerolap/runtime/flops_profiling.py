"""ds_config's ``flops_profiler`` in the engine: when rank 0 profiles, and what it prints.

DeepSpeed counts and times the same forward, so the counting's own cost lands in its
latencies. Here the two are apart, each on real training forwards:

1. Step ``profile_step``: every forward is timed module by module, and the engine's phases
   give the step's forward, backward and optimizer times (no counting runs).
2. The first forward after that step is counted (``zerolap.profiling.flops``), and the profile
   is printed when it ends: summary, aggregated view, module tree.

A run that stops before that forward prints nothing.
"""

from __future__ import annotations

import enum
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
        self._phases: dict[str, float] = defaultdict(float)
        self._forwards = 0
        self._recording = None

    # -- the engine's calls -----------------------------------------------------------------

    def before_forward(self, global_steps: int) -> None:
        if self.stage is _Stage.WAITING and global_steps == self.section.profile_step:
            self.stage = _Stage.TIMING
            self._start(count=False, profile=self.timed)
        elif self.stage is _Stage.COUNTING:
            self.counted = ModelProfile(self.model)
            self._start(count=True, profile=self.counted)
        if self.stage is _Stage.TIMING:
            self._forwards += 1

    def after_forward(self) -> None:
        if self.stage is not _Stage.COUNTING or self._recording is None:
            return
        self._stop()
        self.stage = _Stage.DONE
        self._print()

    def record(self, phase: str, start: float, end: float, compute: bool = True) -> None:
        if self.stage is not _Stage.TIMING:
            return
        if phase != "step_end":
            self._phases[phase] += end - start
            return
        self._stop()
        self.timed.timed_passes = max(self._forwards, 1)
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
        phases, forwards = self._phases, max(self._forwards, 1)
        times = StepTimes(
            forward=phases["forward"] / forwards,
            backward=(phases["backward"] + phases["backward_wait"]) / forwards,
            step=phases["optimizer"] + phases["allgather_wait"],
            micro_batches=forwards,
            **self.describe(),
        )
        self.timed.own_flops = self.counted.own_flops
        text = model_report(
            self.timed,
            profile_step=self.section.profile_step,
            module_depth=self.section.module_depth,
            top_modules=self.section.top_modules,
            detailed=self.section.detailed,
            times=times,
            recompute_fwd_factor=self.section.recompute_fwd_factor,
        )
        write_report(text, self.section.output_file)
