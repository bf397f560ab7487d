"""What each pipeline stage does, in order: pure lists of steps, and a simulator that runs them.

1F1B (PipeDream-Flush, the schedule of DeepSpeed's and Megatron's pipelines): stage ``s`` of
``p`` first runs ``min(p - s - 1, m)`` forward passes (warm-up), then alternates one forward and
one backward until every micro-batch is in flight, then runs the remaining backward passes
(cool-down). At most ``p - s`` micro-batches' activations are alive on stage ``s`` at once, and
with equal forward and backward costs on every stage each stage idles ``(p - 1) / (m + p - 1)``
of the batch: the *bubble*.

Messages follow from the steps: a forward on stage ``s > 0`` needs the activations of its
micro-batch from stage ``s - 1``; a backward on stage ``s < p - 1`` needs the gradients of its
outputs from stage ``s + 1``. Each stage receives in micro-batch order in each direction, which is
the order its neighbour sends in, so plain per-peer send and receive never cross.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = [
    "Op",
    "Step",
    "forward_only",
    "one_f_one_b",
    "simulate",
    "theoretical_bubble",
]


class Op(Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class Step:
    op: Op
    micro_batch: int


def one_f_one_b(*, stages: int, stage: int, micro_batches: int) -> list[Step]:
    """Stage ``stage``'s steps for one batch of ``micro_batches`` under 1F1B."""
    warmup = min(stages - stage - 1, micro_batches)
    steps = [Step(Op.FORWARD, i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        steps += [Step(Op.FORWARD, warmup + i), Step(Op.BACKWARD, i)]
    steps += [Step(Op.BACKWARD, i) for i in range(micro_batches - warmup, micro_batches)]
    return steps


def forward_only(*, micro_batches: int) -> list[Step]:
    """Evaluation: every micro-batch forward, in order, on every stage."""
    return [Step(Op.FORWARD, i) for i in range(micro_batches)]


def theoretical_bubble(*, stages: int, micro_batches: int) -> float:
    """The idle fraction of each stage under 1F1B with equal costs everywhere."""
    return (stages - 1) / (micro_batches + stages - 1)


def simulate(
    schedules: list[list[Step]],
    *,
    forward_s: float | list[float] = 1.0,
    backward_s: float | list[float] = 2.0,
) -> list[tuple[float, float]]:
    """Run each stage's steps with the given costs (one for all stages, or one per stage) and
    free messages; per stage, ``(busy, span)``: its compute time and the time from the batch's
    start to the last stage's end. Raises ``RuntimeError`` on a deadlock (a step whose input
    is never produced)."""
    stages = len(schedules)
    forward_s = forward_s if isinstance(forward_s, list) else [forward_s] * stages
    backward_s = backward_s if isinstance(backward_s, list) else [backward_s] * stages
    done: dict[tuple[int, Op, int], float] = {}
    position, clock = [0] * stages, [0.0] * stages
    busy = [0.0] * stages
    progressed = True
    while progressed:
        progressed = False
        for s, steps in enumerate(schedules):
            while position[s] < len(steps):
                step = steps[position[s]]
                if step.op is Op.FORWARD:
                    needs = (s - 1, Op.FORWARD, step.micro_batch) if s > 0 else None
                    cost = forward_s[s]
                else:
                    needs = (s + 1, Op.BACKWARD, step.micro_batch) if s < stages - 1 else None
                    cost = backward_s[s]
                if needs is not None and needs not in done:
                    break
                if step.op is Op.BACKWARD and (s, Op.FORWARD, step.micro_batch) not in done:
                    break  # its own forward has not run: it never will before this
                start = max(clock[s], done[needs] if needs is not None else 0.0)
                clock[s] = start + cost
                busy[s] += cost
                done[(s, step.op, step.micro_batch)] = clock[s]
                position[s] += 1
                progressed = True
    stuck = [s for s in range(stages) if position[s] < len(schedules[s])]
    if stuck:
        raise RuntimeError(
            f"the schedule deadlocks: stage(s) {stuck} wait for a message never sent"
        )
    return [(busy[s], max(clock)) for s in range(stages)]
