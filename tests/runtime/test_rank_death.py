"""A rank killed in the middle of training: every survivor raises ``CommError`` within its
timeout, none aborts in C++, and the survivors next to the dead rank name it. Four ranks, so
that some survivors are not the dead rank's ring neighbours (those once aborted: the next ring
op's messages reached a neighbour still waiting in the failed one)."""

from __future__ import annotations

import os

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.multiproc import RankFailure, run_on_ranks

VICTIM = 2


def train_until_killed(stage: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    engine, *_ = zerolap.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": 20_000,  # several buckets in flight at once
                "stage3_param_persistence_threshold": 0,
            },
        },
    )
    for step in range(100):
        if dist.get_rank() == VICTIM and step == 3:
            os._exit(9)
        engine.backward(engine(torch.randn(2, 256)).sum())
        engine.step()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_killed_rank_makes_every_survivor_raise(stage):
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(train_until_killed, 4, stage, timeout=100)
    answers = failure.value.answers
    assert answers[VICTIM] == (False, f"rank {VICTIM} exited with code 9"), answers[VICTIM]
    survivors = [answers[rank][1] for rank in range(4) if rank != VICTIM]
    for report in survivors:
        assert "CommError" in report and "exited with code" not in report, report
    named = f"rank {VICTIM} closed the connection: it exited or died"
    assert sum(named in report for report in survivors) >= 2, survivors  # both neighbours
