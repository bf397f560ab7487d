"""Misuse named instead of trained through. With ``zero_optimization.ignore_unused_parameters:
false`` (DeepSpeed's meaning: an unused parameter is an error), a module that takes no part in
the forward fails the backward on every rank, naming its parameters, at every stage; by default
(true) the run trains on. And
``step()`` with no ``backward()`` since the last step is an error that leaves the parameters
alone. ``save_checkpoint`` on one rank only fails on every rank within seconds."""

from __future__ import annotations

import time

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.multiproc import run_on_ranks
from tests.zero.models import global_batch, loss_fn, make_model

MICRO = 2


def backward_with_an_unused_module(stage: int, ignore: bool) -> str:
    model = make_model()
    model.spare = torch.nn.Linear(3, 3)  # never called in forward
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {
            "stage": stage,
            "ignore_unused_parameters": ignore,
            "stage3_param_persistence_threshold": 0,
        },
    }
    engine, *_ = zerolap.initialize(model=model, config=config)
    rank = dist.get_rank()
    tokens, targets = global_batch(0, MICRO * dist.get_world_size())
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    try:
        engine.backward(loss_fn(engine(tokens[mine]), targets[mine]))
        engine.step()
    except RuntimeError as err:
        return str(err)
    finally:
        engine.destroy()
    return "trained"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unused_parameters_are_an_error_when_asked(ranks, stage):
    for rank, message in enumerate(ranks(2).run(backward_with_an_unused_module, stage, False)):
        assert message.startswith(
            f"parameters got no gradient in this accumulation cycle (on rank {rank}: "
            "spare.weight, spare.bias) and zero_optimization.ignore_unused_parameters is false"
        ), message
    assert ranks(2).run(backward_with_an_unused_module, stage, True) == ["trained"] * 2


def step_without_backward() -> str:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    }
    engine, *_ = zerolap.initialize(model=make_model(), config=config)
    before = [p.detach().clone() for p in engine.module.parameters()]
    try:
        engine.step()
    except RuntimeError as err:
        after = list(engine.module.parameters())
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
        assert engine.global_steps == 0
        return str(err)
    finally:
        engine.destroy()
    return "stepped"


def test_step_before_backward_is_an_error(ranks):
    for message in ranks(2).run(step_without_backward):
        assert message == (
            "step() at step 0 with no backward() since the last step (or zero_grad()): call "
            "engine.backward(loss) first"
        )


def train_on_uneven_data() -> list[int]:
    """Rank 1 has one batch fewer: with the per-step agreement every rank stops after the
    batches all of them have, instead of rank 0 hanging in its extra step."""
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = zerolap.initialize(model=make_model(), config=config)
    rank = dist.get_rank()
    batches = iter([global_batch(step, MICRO) for step in range(4 - rank)])
    while engine.all_ranks_have_data((batch := next(batches, None)) is not None):
        tokens, targets = batch
        engine.backward(loss_fn(engine(tokens), targets))
        engine.step()
    steps = engine.global_steps
    engine.destroy()
    return [steps, sum(1 for _ in batches)]


def test_uneven_data_stops_every_rank_together(ranks):
    assert ranks(2).run(train_on_uneven_data, timeout=60) == [[3, 0], [3, 0]]


def used_in_one_micro_batch_of_the_cycle(stage: int, used_in: int) -> str:
    """A parameter used in one micro-batch of an accumulation cycle and not the other is used:
    no error with ignore_unused_parameters false, whichever micro-batch it is (stage 2 reduces
    every micro-batch; the cycle is judged at its end)."""
    model = make_model()
    model.spare = torch.nn.Linear(3, 3)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage, "ignore_unused_parameters": False},
    }
    engine, *_ = zerolap.initialize(model=model, config=config)
    tokens, targets = global_batch(0, MICRO)
    for micro in range(2):
        loss = loss_fn(engine(tokens), targets)
        if micro == used_in:
            loss = loss + model.spare(torch.ones(3)).sum() * 0.0
        engine.backward(loss)
        engine.step()
    engine.destroy()
    return "trained"


@pytest.mark.parametrize("stage", [1, 2])
def test_unused_is_judged_over_the_accumulation_cycle(ranks, stage):
    for used_in in (0, 1):
        result = ranks(2).run(used_in_one_micro_batch_of_the_cycle, stage, used_in)
        assert result == ["trained"] * 2


def save_on_one_rank(path: str) -> str:
    """Rank 0 saves while rank 1 trains on: both fail within seconds (the watchdog sees each
    blocked where the other can never come), instead of waiting out the timeout."""
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = zerolap.initialize(model=make_model(), config=config)
    tokens, targets = global_batch(0, MICRO)
    engine.backward(loss_fn(engine(tokens), targets))
    engine.step()
    start = time.monotonic()
    with pytest.raises((dist.CheckInError, dist.CommError)) as error:
        if dist.get_rank() == 0:
            engine.save_checkpoint(path)
        else:
            engine.backward(loss_fn(engine(tokens), targets))
    assert time.monotonic() - start < 10  # the process group's timeout in tests is 45 s
    time.sleep(3)  # the other side may still be reading rank 0's store to reach its verdict
    return str(error.value)


def test_save_checkpoint_on_one_rank_fails_fast(tmp_path):
    env = {"ZEROLAP_WATCHDOG_INTERVAL": "0.5"}
    saver, trainer = run_on_ranks(save_on_one_rank, 2, str(tmp_path), env=env, timeout=60)
    assert "save_checkpoint must be called on every rank of [0, 1]: rank 1 waits in" in saver
    assert "rank 0 is in save_checkpoint, which every rank of [0, 1] must call" in trainer
    assert not any(tmp_path.iterdir())  # nothing written
