"""What a train_batch's pipeline did, from every stage's record of it: per stage, the bubble
(its idle share of the batch, from the first stage's start to the last one's end) against the
theory, and the point-to-point time it sat exposed to.

Every stage records its compute steps and its messages (``PipelineEngine.last_stats``) on this
host's monotonic clock, so records from stages on one host line up. The theory is twofold:
(p - 1) / (m + p - 1) (ZB-H1: (p - 1) / (3 m + p - 1)), which assumes equal stages and steps,
and the same schedule simulated with the stages' own median forward, backward and weight step
times (``schedule.simulate``): the bubble these stages would have if messages were free. The
measured bubble minus the simulated one is what the messages and the host cost.
"""

from __future__ import annotations

import statistics

from zerolap.pipe.schedule import schedule, simulate, theoretical_bubble

__all__ = ["batch_report"]


def batch_report(stages: list[dict]) -> dict:
    """``stages``: every stage's ``last_stats`` of one train_batch, in stage order."""
    count, micro_batches, chunks = len(stages), stages[0]["micro_batches"], stages[0]["chunks"]
    kind = stages[0]["schedule"]
    begin = min(s["start"] for s in stages)
    window = max(s["start"] + s["schedule_s"] for s in stages) - begin
    schedules = [
        schedule(stages=count, stage=s, micro_batches=micro_batches, chunks=chunks, kind=kind)
        for s in range(count)
    ]
    # A stage's forward and backward (and ZB-H1's weight step): its chunks' median step times
    # its chunks.
    forward = [_median(s["steps"], "forward") * chunks for s in stages]
    backward = [_median(s["steps"], "backward") * chunks for s in stages]
    weight = [_median(s["steps"], "weight") * chunks for s in stages]
    ideal = simulate(
        schedules, forward_s=forward, backward_s=backward, weight_s=weight, chunks=chunks
    )
    sent = {
        (direction, mb, channel): issued
        for s in stages
        for kind, direction, mb, issued, _, _, channel in s["p2p"]
        if kind == "send"
    }
    exposed = []
    for s in stages:
        waits = [e for e in s["p2p"] if e[0] == "wait" and e[1] != "METADATA"]
        exposed.append(
            sum(
                max(0.0, end - max(began, sent[(d, mb, channel)]))
                for _, d, mb, began, end, _, channel in waits
            )
        )
    return {
        "micro_batches": micro_batches,
        "chunks": chunks,
        "schedule": kind,
        "batch_s": window,
        "bubble": [1.0 - s["compute_s"] / window for s in stages],
        "bubble_formula": theoretical_bubble(
            stages=count, micro_batches=micro_batches, chunks=chunks, kind=kind
        ),
        "bubble_simulated": [1.0 - busy / span for busy, span in ideal],
        "forward_s": forward,
        "backward_s": backward,
        "weight_s": weight,
        "p2p_wait_s": [s["p2p_wait_s"] for s in stages],
        "exposed_p2p_s": exposed,
    }


def _median(steps: list, op: str) -> float:
    """The median time of ``op``'s steps (0 when there are none: no weight steps but ZB-H1's)."""
    times = [end - start for kind, _, start, end in steps if kind == op]
    return statistics.median(times) if times else 0.0
