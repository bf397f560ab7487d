"""ds_config's debugging keys, each read where DeepSpeed reads it: ``memory_breakdown``
(memory logged around every phase), ``dump_state`` (the resolved config and the engine's
layout), ``log_level`` and ``disable_python_gc``."""

from __future__ import annotations

import gc

import torch

import zerolap
import zerolap.comm as dist
from tests.logs import captured_logs
from zerolap.utils.logging import logger, set_log_level_from_string


def _engine(**extra):
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        **extra,
    }
    engine, *_ = zerolap.initialize(model=torch.nn.Linear(4, 2), config=config)
    return engine


def _train(engine, micro_batches: int) -> None:
    for _ in range(micro_batches):
        engine.backward(engine(torch.randn(2, 4)).pow(2).sum())
        engine.step()


def check_memory_breakdown_and_dump_state() -> dict:
    with captured_logs() as logs:
        engine = _engine(memory_breakdown=True, dump_state=True)
        _train(engine, 2)
    engine.destroy()
    phases = [line.split(": ", 1)[1] for line in logs if ": Engine " in line]
    dumps = [line for line in logs if "engine state (ds_config dump_state)" in line]
    return {"phases": phases, "dumps": dumps, "memory": [x for x in logs if "Max_MA" in x]}


def test_memory_breakdown_and_dump_state_log_on_rank_0(ranks):
    first, second = ranks(2).run(check_memory_breakdown_and_dump_state)
    one = ["before forward", "after forward", "before backward", "after backward"]
    one += ["before step", "after step"]
    each = [f"Engine {phase}" for phase in one]
    assert first["phases"] == ["Engine after initialize", *each, *each]  # each micro-batch
    assert len(first["memory"]) == len(first["phases"])  # each with its figures
    (dump,) = first["dumps"]
    assert '"stage": 2' in dump and '"gradient_accumulation_steps": 2' in dump
    assert "ZeRO stage: 2" in dump and "ranks (data x tensor x pipeline x sequence): 2" in dump
    assert second == {"phases": [], "dumps": [], "memory": []}


def check_log_level() -> list[str]:
    try:
        with captured_logs() as logs:
            _train(_engine(log_level="WARNING", steps_per_print=1), 2)
            logger.info("an info line")
            logger.warning("a warning line")
        return logs
    finally:
        set_log_level_from_string("info")


def test_log_level_sets_the_logger(ranks):
    for logs in ranks(2).run(check_log_level):
        assert "WARNING: a warning line" in logs
        assert not any(line.startswith("INFO") for line in logs)  # step lines included


def check_python_gc() -> dict:
    assert gc.isenabled()
    first = _engine(disable_python_gc=True)
    second = _engine(disable_python_gc=True)
    states = [gc.isenabled()]
    _train(first, 2)
    found = first.collect_python_gc()
    first.destroy()
    states.append(gc.isenabled())  # the second engine still wants it off
    del second  # dropped without destroy(): its share is given back when it goes
    gc.collect()
    states.append(gc.isenabled())
    plain = _engine()
    states.append(gc.isenabled())
    plain.destroy()
    return {"states": states, "found": found, "rank": dist.get_rank()}


def test_disable_python_gc_while_an_engine_asks(ranks):
    for result in ranks(2).run(check_python_gc):
        assert result["states"] == [False, False, True, True]
        assert isinstance(result["found"], int)
