"""Ranks given different jobs fail at ``initialize``, on every rank, with the first difference
named, instead of training on diverging or hanging in a collective whose sizes differ."""

from __future__ import annotations

import os

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.zero.models import make_model
from zerolap.config import ConfigError, parse_config
from zerolap.runtime.agreement import describe


def _config(**extra) -> dict:
    base = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2},
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def initialize_with(differing: int, case: str) -> str:
    """Every rank initializes; rank ``differing`` got a different job, as ``case`` says."""
    odd = dist.get_rank() == differing
    config, model = _config(), make_model()
    if odd and case == "clipping":
        config = _config(gradient_clipping=0.5)
    if odd and case == "micro batch":
        config = _config(train_micro_batch_size_per_gpu=4)
    if odd and case == "stage":
        config = _config(zero_optimization={"stage": 3})
    if odd and case == "bf16":
        config = _config(bf16={"enabled": True})
    if odd and case == "hidden size":
        model.proj = torch.nn.Linear(8, 5)
    if odd and case == "frozen":
        next(model.parameters()).requires_grad_(False)
    if case == "rank-local":  # where each rank logs and keeps its swap files: its own business
        offload = {"device": "nvme", "nvme_path": f"/tmp/zerolap-agreement-{dist.get_rank()}"}
        config = _config(steps_per_print=10 if odd else 100, wall_clock_breakdown=odd)
        config["zero_optimization"]["offload_optimizer"] = offload
        os.makedirs(offload["nvme_path"], exist_ok=True)
    try:
        engine, *_ = zerolap.initialize(model=model, config=config)
    except ConfigError as err:
        return str(err)
    engine.destroy()
    return "initialized"


@pytest.mark.parametrize(
    "case, where, ours, theirs",
    [
        ("clipping", "the ds_config differs at gradient_clipping", "1.0", "0.5"),
        ("micro batch", "the ds_config differs at train_micro_batch_size_per_gpu", "2", "4"),
        ("stage", "the ds_config differs at zero_optimization.stage", "2", "3"),
        ("bf16", "the ds_config differs at bf16.enabled", "false", "true"),
    ],
)
def test_different_configs_are_named_on_every_rank(ranks, case, where, ours, theirs):
    messages = ranks(2).run(initialize_with, 1, case)
    want = (
        f"the ranks were not given the same job: {where}: rank 0 has {ours}, rank 1 has "
        f"{theirs} (ranks differing from rank 0: [1])"
    )
    assert messages == [want, want]


def test_different_models_are_named_on_every_rank(ranks):
    messages = ranks(4).run(initialize_with, 2, "hidden size")
    assert len(set(messages)) == 1
    assert "the model differs at parameter proj.weight" in messages[0]
    assert "(ranks differing from rank 0: [2])" in messages[0]
    messages = ranks(2).run(initialize_with, 1, "frozen")
    assert "(frozen)" in messages[0] and messages[0] == messages[1]


def test_the_same_job_initializes(ranks):
    assert describe(parse_config(_config()), make_model()) == describe(
        parse_config(_config()), make_model()
    )
    assert ranks(2).run(initialize_with, 1, "same") == ["initialized", "initialized"]
    assert ranks(2).run(initialize_with, 1, "rank-local") == ["initialized", "initialized"]


def test_rank_local_settings_may_differ():
    """Where a rank logs, and where its host mounts its swap disk, are its own business."""
    offload = {"offload_optimizer": {"device": "nvme", "nvme_path": "/mnt/a"}}
    one = _config(zero_optimization=offload, steps_per_print=10, wall_clock_breakdown=True)
    offload = {"offload_optimizer": {"device": "nvme", "nvme_path": "/scratch/b"}}
    other = _config(zero_optimization=offload, comms_logger={"enabled": True})
    model = make_model()
    assert describe(parse_config(one), model) == describe(parse_config(other), model)


def one_rank_with_an_invalid_config() -> str:
    config = _config(zero_optimization={"stage": 7}) if dist.get_rank() == 1 else _config()
    try:
        zerolap.initialize(model=make_model(), config=config)
    except ConfigError as err:
        return str(err)
    return "initialized"


def test_an_invalid_config_on_one_rank_fails_every_rank_without_a_hang(ranks):
    rank0, rank1 = ranks(2).run(one_rank_with_an_invalid_config, timeout=60)
    assert (
        rank0 == "the ds_config of ranks [1] is invalid (their own error says why); this "
        "rank's (rank 0) is valid"
    )
    assert "zero_optimization.stage" in rank1
