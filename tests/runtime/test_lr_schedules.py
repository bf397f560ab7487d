"""The warmup schedules against hand-computed DeepSpeed values, and build_scheduler's errors."""

from __future__ import annotations

import math

import pytest
import torch

from tests.logs import captured_logs
from zerolap.runtime.lr_schedules import (
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def sgd(lrs=(1.0,)) -> torch.optim.SGD:
    groups = [{"params": [torch.zeros(2, requires_grad=True)], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups)


def lr_at(scheduler, iteration: int) -> float:
    """The lr after ``iteration + 1`` step() calls, read back from the optimizer."""
    scheduler.step(iteration)
    lr = scheduler.optimizer.param_groups[0]["lr"]
    assert scheduler.get_last_lr()[0] == lr
    return lr


def test_warmup_lr_linear():
    opt = sgd()
    s = WarmupLR(
        opt, warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=10, warmup_type="linear"
    )
    assert opt.param_groups[0]["lr"] == 0.1  # set at construction, iteration -1
    s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # iteration 0: still min
    assert lr_at(s, 5) == pytest.approx(0.6)
    assert lr_at(s, 9) == pytest.approx(1.0)
    assert lr_at(s, 10) == pytest.approx(1.1)
    assert lr_at(s, 1000) == pytest.approx(1.1)


def test_warmup_lr_log():
    s = WarmupLR(sgd(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10)
    assert lr_at(s, 0) == 0.0
    assert lr_at(s, 4) == pytest.approx(math.log(5) / math.log(10))
    assert lr_at(s, 9) == pytest.approx(1.0)
    assert lr_at(s, 50) == 1.0


def test_warmup_lr_defaults_take_group_lrs_and_clamp_steps():
    opt = sgd(lrs=(0.5, 2.0))
    s = WarmupLR(opt, warmup_num_steps=1, warmup_type="linear")
    assert s.warmup_num_steps == 2
    assert s.get_last_lr() == [0.0, 0.0]
    s.step(1)
    assert s.get_last_lr() == [0.25, 1.0]
    s.step(2)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 2.0]


def test_warmup_lr_per_group_values():
    opt = sgd(lrs=(1.0, 1.0))
    s = WarmupLR(opt, [0.0, 0.5], [1.0, 2.0], warmup_num_steps=10, warmup_type="linear")
    s.step(5)
    assert s.get_last_lr() == pytest.approx([0.5, 1.25])
    with pytest.raises(ValueError, match=r"warmup_min_lr has 3 values for 2 param groups"):
        WarmupLR(opt, [0.0, 0.1, 0.2])


@pytest.mark.parametrize("warmup_type", ["linear", "log"])
def test_warmup_decay_lr(warmup_type):
    s = WarmupDecayLR(
        sgd(),
        total_num_steps=20,
        warmup_min_lr=0.1,
        warmup_max_lr=1.1,
        warmup_num_steps=10,
        warmup_type=warmup_type,
    )
    fraction = 5 / 10 if warmup_type == "linear" else math.log(6) / math.log(10)
    assert lr_at(s, 0) == pytest.approx(0.1)
    assert lr_at(s, 5) == pytest.approx(0.1 + fraction)
    assert lr_at(s, 10) == pytest.approx(1.1)  # (20 - 10) / (20 - 10)
    assert lr_at(s, 15) == pytest.approx(0.6)  # half way down
    assert lr_at(s, 20) == pytest.approx(0.1)
    assert lr_at(s, 30) == pytest.approx(0.1)  # clamped at min


def test_warmup_decay_default_max_lr_is_deepspeeds():
    s = WarmupDecayLR(sgd(lrs=(5.0,)), total_num_steps=20, warmup_num_steps=10)
    assert lr_at(s, 10) == pytest.approx(0.001)


@pytest.mark.parametrize("warmup_type", ["linear", "log"])
def test_warmup_cosine_lr(warmup_type):
    opt = sgd(lrs=(2.0,))
    s = WarmupCosineLR(
        opt,
        total_num_steps=20,
        warmup_min_ratio=0.1,
        warmup_num_steps=10,
        cos_min_ratio=0.01,
        warmup_type=warmup_type,
    )
    assert opt.param_groups[0]["lr"] == 0.0  # DeepSpeed starts at 0, not at warmup_min_ratio
    fraction = 0.5 if warmup_type == "linear" else math.log(6) / math.log(10)
    assert lr_at(s, 0) == pytest.approx(2.0 * 0.1)
    assert lr_at(s, 5) == pytest.approx(2.0 * (0.1 + 0.9 * fraction))
    # End of warmup: the cosine is already 1/10 of the way along.
    first_cosine = 0.01 + 0.99 * (1 + math.cos(math.pi * 0.1)) / 2
    assert lr_at(s, 10) == pytest.approx(2.0 * first_cosine)
    assert lr_at(s, 14) == pytest.approx(2.0 * (0.01 + 0.99 * 0.5))
    assert lr_at(s, 19) == pytest.approx(2.0 * 0.01)
    assert lr_at(s, 40) == pytest.approx(2.0 * 0.01)  # holds at the floor


def test_state_round_trip_reapplies_lr():
    opt = sgd()
    s = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    for _ in range(6):
        s.step()
    state = s.state_dict()
    assert state == {"last_batch_iteration": 5}

    fresh_opt = sgd()
    fresh = WarmupLR(fresh_opt, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    fresh.load_state_dict(state)
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(0.5)
    s.step()
    fresh.step()
    assert fresh.get_last_lr() == s.get_last_lr()


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"warmup_type must be one of"):
        WarmupLR(sgd(), warmup_type="cosine")
    with pytest.raises(ValueError, match=r"warmup_num_steps must be positive"):
        WarmupLR(sgd(), warmup_num_steps=0)
    with captured_logs() as logs:
        WarmupDecayLR(sgd(), total_num_steps=5, warmup_num_steps=10)
    assert logs == ["WARNING: total_num_steps 5 is less than warmup_num_steps 10"]


def test_build_scheduler():
    s = build_scheduler("warmuplr", {"warmup_max_lr": 0.5, "warmup_num_steps": 4}, sgd())
    assert isinstance(s, WarmupLR)
    s = build_scheduler("WarmupCosineLR", {"total_num_steps": 2000}, sgd())
    assert isinstance(s, WarmupCosineLR)
    torch_one = build_scheduler("StepLR", {"step_size": 2}, sgd())
    assert isinstance(torch_one, torch.optim.lr_scheduler.StepLR)


def test_build_scheduler_errors():
    with pytest.raises(ValueError, match=r"scheduler.type 'OneCycle'.*WarmupLR, WarmupDecayLR"):
        build_scheduler("OneCycle", {}, sgd())
    with pytest.raises(ValueError, match=r"scheduler.params.warmup_max is not.*'warmup_max_lr'"):
        build_scheduler("WarmupLR", {"warmup_max": 0.1}, sgd())
    with pytest.raises(ValueError, match=r"scheduler.params for 'WarmupDecayLR'.*total_num_steps"):
        build_scheduler("WarmupDecayLR", {}, sgd())
    with pytest.raises(ValueError, match=r"scheduler.params for 'WarmupLR'.*warmup_type"):
        build_scheduler("WarmupLR", {"warmup_type": "exp"}, sgd())
