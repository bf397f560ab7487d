"""ds_config's ``wall_clock_breakdown``: per-phase wall time, printed every ``steps_per_print``.

The engine reports phases to every attached recorder (this one, a ``StepProfiler``, ...):
``forward``, ``backward`` (autograd), ``backward_wait`` (the end-of-backward wait for gradient
reductions), ``optimizer``, ``allgather_wait`` (updated parameters arriving within ``step()``)
and ``step_end``; waits inside forward and backward are part of those phases and not counted
again: ``param_wait`` (stages 1-2, a bucket's deferred all-gather awaited by the first module
using it) and ``fetch_wait`` (stage 3, parameters awaited).
"""

from __future__ import annotations

from collections import defaultdict

from zerolap.utils.logging import logger

__all__ = ["TIMED", "WallClockBreakdown"]

TIMED = (
    ("fwd", "forward", ("forward",)),
    ("bwd", "backward", ("backward", "backward_wait")),
    ("bwd_inner", "backward_inner", ("backward",)),
    ("bwd_allreduce", "backward_allreduce", ("backward_wait",)),
    ("step", "step", ("optimizer", "allgather_wait")),
)
"""What DeepSpeed's timers time, from the engine's phases: (printed label, DeepSpeed's timer
name as its monitor events spell it, the phases summed)."""


class WallClockBreakdown:
    def __init__(self, *, steps_per_print: int | None, rank: int) -> None:
        self.steps_per_print = steps_per_print
        self.rank = rank
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0

    def record(self, phase: str, start: float, end: float, compute: bool = True) -> None:
        if phase != "step_end":
            self.totals[phase] += end - start
            return
        self.steps += 1
        if self.steps_per_print and self.steps % self.steps_per_print == 0:
            if self.rank == 0:
                logger.info(self.format())
            self.totals.clear()

    def means_ms(self) -> dict[str, float]:
        per = self.steps_per_print or 1
        return {
            label: sum(self.totals[p] for p in phases) * 1e3 / per for label, _, phases in TIMED
        }

    def format(self) -> str:
        parts = " | ".join(f"{k}: {v:.2f}" for k, v in self.means_ms().items())
        return f"[rank {self.rank}] step {self.steps} time (ms) | {parts}"
