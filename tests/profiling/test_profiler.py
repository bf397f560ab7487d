"""The profiler on a real 2-rank engine, and ds_config's wall_clock_breakdown timers."""

from __future__ import annotations

import torch

import zerolap
import zerolap.comm as dist
from tests.logs import captured_logs
from zerolap.profiling.profiler import StepProfiler
from zerolap.profiling.timeline import COMM, COMPUTE


def _engine(**extra):
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(3)]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(64, 1))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 4096},
        **extra,
    }
    engine, *_ = zerolap.initialize(model=model, config=config)
    return engine, blocks


def check_profiler_spans_and_stats() -> dict:
    engine, blocks = _engine()
    with StepProfiler(engine, blocks=blocks) as prof:
        for _ in range(3):
            engine.backward(engine(torch.randn(4, 64)).pow(2).mean())
            engine.step()
    assert not dist.COMMS_LOGGER.enabled  # restored on exit
    names = {(s.lane, s.name) for s in prof.spans}
    assert {(COMPUTE, "forward"), (COMPUTE, "backward"), (COMPUTE, "optimizer")} <= names
    assert {(COMPUTE, "forward:block0"), (COMPUTE, "backward:block2")} <= names
    assert {(COMM, "ring_reduce_scatter"), (COMM, "ring_all_gather")} <= names
    assert len(prof.stats) == 3 and {s.step for s in prof.spans} == {0, 1, 2}
    summary = prof.summary()
    assert summary["steps"] == 2 and 0 <= summary["eta"] <= 1
    assert summary["comm_s"] > 0 and summary["compute_s"] > 0
    assert summary["exposed_comm_s"] <= summary["comm_s"] + 1e-9
    all_spans = prof.gather_spans()
    assert {s.rank for s in all_spans} == {0, 1}
    return summary


def test_profiler_records_phases_blocks_and_collectives(ranks):
    ranks(2).run(check_profiler_spans_and_stats)


def check_wall_clock_breakdown() -> str:
    engine, _ = _engine(wall_clock_breakdown=True, steps_per_print=2)
    with captured_logs() as logs:
        for _ in range(4):
            engine.backward(engine(torch.randn(4, 64)).pow(2).mean())
            engine.step()
    return "\n".join(logs)


def test_wall_clock_breakdown_prints_every_steps_per_print(ranks):
    printed = ranks(2).run(check_wall_clock_breakdown)
    lines = [line for line in printed[0].splitlines() if "time (ms)" in line]
    assert len(lines) == 2 and "step 2" in lines[0] and "step 4" in lines[1]
    for key in ("fwd:", "bwd:", "bwd_inner:", "bwd_allreduce:", "step:"):
        assert key in lines[0]
    assert printed[1] == ""  # rank 0 prints
