"""What each pipeline stage does, in order: pure lists of steps, and a simulator that runs them.

1F1B (PipeDream-Flush, the schedule of DeepSpeed's and Megatron's pipelines): stage ``s`` of
``p`` first runs ``min(p - s - 1, m)`` forward passes (warm-up), then alternates one forward and
one backward until every micro-batch is in flight, then runs the remaining backward passes
(cool-down). At most ``p - s`` micro-batches' activations are alive on stage ``s`` at once, and
with equal forward and backward costs on every stage each stage idles ``(p - 1) / (m + p - 1)``
of the batch: the *bubble*.

Interleaved 1F1B (Megatron's virtual stages): the layers are split into ``p x v`` chunks and
rank ``s`` holds chunks ``s, s + p, s + 2p, ...``, so a micro-batch goes round the ranks ``v``
times. Each step is a chunk's, ``1 / v`` of a stage's work, and the warm-up and cool-down are
counted in those smaller steps: the bubble falls to ``(p - 1) / (v m + p - 1)``, for ``v``
times the messages. Micro-batches go in groups of ``p``: ``m`` must be a multiple of ``p``.

ZB-H1 (zero bubble, Qi et al. 2023, the variant that keeps 1F1B's activation count): each
backward is split in two, ``BACKWARD`` computing only the gradients of the stage's inputs (what
the previous stage waits for) and ``WEIGHT`` the weight gradients of its linear layers, which
nobody waits for. Stage ``s`` runs 1F1B's forward and backward order, each weight step after
its backward, except that it keeps ``s`` of them deferred: the later a stage, the sooner its
input gradients leave for the stages waiting on them, and the deferred weight steps fill the
cool-down, where 1F1B idles. With forward, input-gradient and weight-gradient steps of equal
cost the bubble falls from ``(p - 1) / (m + p - 1)`` to ``(p - 1) / (3 m + p - 1)``, and stage
``s`` holds at most ``p - s`` micro-batches' activations plus ``s`` deferred weight steps'
linear inputs and output gradients (at most ``p`` micro-batches in all, 1F1B's first stage's
count).

Messages follow from the steps: a forward of global chunk ``g > 0`` needs the activations of
its micro-batch from chunk ``g - 1`` (on the previous rank, the last rank's going round to rank
0); a backward of a chunk before the last needs the gradients of its outputs from chunk
``g + 1``. Each rank receives from a neighbour in the order that neighbour sends in, so plain
per-peer send and receive never cross.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = [
    "Op",
    "Step",
    "forward_only",
    "interleaved_1f1b",
    "one_f_one_b",
    "schedule",
    "simulate",
    "theoretical_bubble",
    "zero_bubble_h1",
]


class Op(Enum):
    FORWARD = "forward"
    BACKWARD = "backward"  # the whole backward, or (ZB-H1) the inputs' gradients only
    WEIGHT = "weight"  # ZB-H1: the deferred weight gradients of a backward already run


@dataclass(frozen=True)
class Step:
    op: Op
    micro_batch: int
    chunk: int = 0  # which of the rank's chunks (always 0 without virtual stages)


def one_f_one_b(*, stages: int, stage: int, micro_batches: int) -> list[Step]:
    """Stage ``stage``'s steps for one batch of ``micro_batches`` under 1F1B."""
    warmup = min(stages - stage - 1, micro_batches)
    steps = [Step(Op.FORWARD, i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        steps += [Step(Op.FORWARD, warmup + i), Step(Op.BACKWARD, i)]
    steps += [Step(Op.BACKWARD, i) for i in range(micro_batches - warmup, micro_batches)]
    return steps


def interleaved_1f1b(*, stages: int, stage: int, micro_batches: int, chunks: int) -> list[Step]:
    """Stage ``stage``'s steps under interleaved 1F1B with ``chunks`` chunks per rank
    (Megatron's order: ``p`` micro-batches through one chunk, then the same through the next)."""
    if micro_batches % stages:
        raise ValueError(
            f"interleaved 1F1B takes micro-batches in groups of the {stages} stages; "
            f"gradient_accumulation_steps={micro_batches} is not a multiple of it"
        )
    total = micro_batches * chunks
    warmup = min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)

    def step(op: Op, k: int) -> Step:
        chunk = (k // stages) % chunks
        mb = (k // (stages * chunks)) * stages + k % stages
        return Step(op, mb, chunk if op is Op.FORWARD else chunks - 1 - chunk)

    steps = [step(Op.FORWARD, k) for k in range(warmup)]
    for i in range(total - warmup):
        steps += [step(Op.FORWARD, warmup + i), step(Op.BACKWARD, i)]
    steps += [step(Op.BACKWARD, k) for k in range(total - warmup, total)]
    return steps


def zero_bubble_h1(*, stages: int, stage: int, micro_batches: int) -> list[Step]:
    """Stage ``stage``'s steps under ZB-H1: 1F1B's forwards and (input-gradient) backwards,
    each backward followed by the oldest deferred weight step once more than ``stage`` are
    waiting (in the cool-down, after every backward); the rest at the end."""
    warmup = min(stages - stage - 1, micro_batches)
    steps = [Step(Op.FORWARD, i) for i in range(warmup)]
    deferred: list[int] = []

    def backward(i: int) -> None:
        steps.append(Step(Op.BACKWARD, i))
        deferred.append(i)

    for i in range(micro_batches - warmup):
        steps.append(Step(Op.FORWARD, warmup + i))
        backward(i)
        if len(deferred) > stage:
            steps.append(Step(Op.WEIGHT, deferred.pop(0)))
    for i in range(micro_batches - warmup, micro_batches):
        backward(i)
        steps.append(Step(Op.WEIGHT, deferred.pop(0)))
    steps += [Step(Op.WEIGHT, i) for i in deferred]
    return steps


def schedule(
    *, stages: int, stage: int, micro_batches: int, chunks: int = 1, kind: str = "1f1b"
) -> list[Step]:
    """The training schedule: 1F1B (interleaved when a rank holds several chunks) or ZB-H1."""
    if kind == "zb-h1":
        return zero_bubble_h1(stages=stages, stage=stage, micro_batches=micro_batches)
    if chunks == 1:
        return one_f_one_b(stages=stages, stage=stage, micro_batches=micro_batches)
    return interleaved_1f1b(stages=stages, stage=stage, micro_batches=micro_batches, chunks=chunks)


def forward_only(*, stages: int = 1, micro_batches: int, chunks: int = 1) -> list[Step]:
    """Evaluation: every micro-batch forward through every chunk, in the training schedule's
    forward order."""
    steps = schedule(stages=stages, stage=0, micro_batches=micro_batches, chunks=chunks)
    return [s for s in steps if s.op is Op.FORWARD]


def theoretical_bubble(
    *, stages: int, micro_batches: int, chunks: int = 1, kind: str = "1f1b"
) -> float:
    """The idle fraction of each stage with equal costs everywhere: (interleaved) 1F1B's, or
    ZB-H1's with equal forward, input-gradient and weight-gradient steps."""
    if kind == "zb-h1":
        return (stages - 1) / (3 * micro_batches + stages - 1)
    return (stages - 1) / (chunks * micro_batches + stages - 1)


def simulate(
    schedules: list[list[Step]],
    *,
    forward_s: float | list[float] = 1.0,
    backward_s: float | list[float] = 2.0,
    weight_s: float | list[float] = 0.0,
    chunks: int = 1,
) -> list[tuple[float, float]]:
    """Run each stage's steps with the given costs (of a whole stage, one for all stages or one
    per stage; a chunk's step costs ``1 / chunks`` of it; ``weight_s`` is a ZB-H1 weight step's)
    and free messages; per stage, ``(busy, span)``: its compute time and the time from the
    batch's start to the last stage's end. Raises ``RuntimeError`` on a deadlock (a step whose
    input is never produced)."""
    stages = len(schedules)

    def per_stage(cost: float | list[float]) -> list[float]:
        return cost if isinstance(cost, list) else [cost] * stages

    forward_s, backward_s, weight_s = map(per_stage, (forward_s, backward_s, weight_s))
    last = stages * chunks - 1  # the global index of the last chunk
    done: dict[tuple[int, Op, int], float] = {}
    position, clock = [0] * stages, [0.0] * stages
    busy = [0.0] * stages
    progressed = True
    while progressed:
        progressed = False
        for s, steps in enumerate(schedules):
            while position[s] < len(steps):
                step = steps[position[s]]
                g, mb = step.chunk * stages + s, step.micro_batch  # the chunk's global index
                if step.op is Op.FORWARD:
                    needs = (g - 1, Op.FORWARD, mb) if g > 0 else None
                    cost = forward_s[s] / chunks
                elif step.op is Op.WEIGHT:
                    needs = (g, Op.BACKWARD, mb)  # its own backward: earlier on this stage
                    cost = weight_s[s] / chunks
                else:
                    needs = (g + 1, Op.BACKWARD, mb) if g < last else None
                    cost = backward_s[s] / chunks
                if needs is not None and needs not in done:
                    break
                if step.op is Op.BACKWARD and (g, Op.FORWARD, mb) not in done:
                    break  # its own forward has not run: it never will before this
                start = max(clock[s], done[needs] if needs is not None else 0.0)
                clock[s] = start + cost
                busy[s] += cost
                done[(g, step.op, mb)] = clock[s]
                position[s] += 1
                progressed = True
    stuck = [s for s in range(stages) if position[s] < len(schedules[s])]
    if stuck:
        raise RuntimeError(
            f"the schedule deadlocks: stage(s) {stuck} wait for a message never sent"
        )
    return [(busy[s], max(clock)) for s in range(stages)]
