"""DeepSpeed's schedules against hand-computed values (the warmups) and their formulas written
out plainly (the range test and the one cycle), and build_scheduler's errors."""

from __future__ import annotations

import math

import pytest
import torch

from tests.logs import captured_logs
from zerolap.runtime.lr_schedules import (
    LRRangeTest,
    OneCycle,
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
    with pytest.raises(ValueError, match=r"scheduler.type 'TwoCycle'.*OneCycle, WarmupLR"):
        build_scheduler("TwoCycle", {}, sgd())
    with pytest.raises(ValueError, match=r"scheduler.params for 'OneCycle'.*cycle_max_lr"):
        build_scheduler("OneCycle", {"cycle_min_lr": 0.1}, sgd())
    with pytest.raises(ValueError, match=r"scheduler.params.warmup_max is not.*'warmup_max_lr'"):
        build_scheduler("WarmupLR", {"warmup_max": 0.1}, sgd())
    with pytest.raises(ValueError, match=r"scheduler.params for 'WarmupDecayLR'.*total_num_steps"):
        build_scheduler("WarmupDecayLR", {}, sgd())
    with pytest.raises(ValueError, match=r"scheduler.params for 'WarmupLR'.*warmup_type"):
        build_scheduler("WarmupLR", {"warmup_type": "exp"}, sgd())


def adamw(lrs=(1.0,)) -> torch.optim.AdamW:
    groups = [{"params": [torch.zeros(2, requires_grad=True)], "lr": lr} for lr in lrs]
    return torch.optim.AdamW(groups, betas=(0.95, 0.999))


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    opt = sgd(lrs=(1.0, 1.0))
    s = LRRangeTest(
        opt,
        lr_range_test_min_lr=[0.01, 0.02],
        lr_range_test_step_size=4,
        lr_range_test_step_rate=0.5,
        lr_range_test_staircase=staircase,
    )
    assert s.get_last_lr() == [0.01, 0.02]  # iteration -1
    for i in range(12):
        intervals = (i + 1) / 4
        if staircase:
            intervals = math.floor(intervals)
        want = [low * (1 + 0.5 * intervals) for low in (0.01, 0.02)]
        assert lr_at(s, i) == pytest.approx(want[0], rel=1e-15)
        assert opt.param_groups[1]["lr"] == pytest.approx(want[1], rel=1e-15)


def one_cycle_at(i, *, lo, hi, s1, s2, stairs=(0, 0), mom=(0.8, 0.9), decay=(0, 0.0, 0.0)):
    """(lr, beta1) at iteration ``i``, written from the schedule's description."""
    if i == -1:
        return lo, mom[0]
    step, rate, mom_rate = decay
    c, total = i + 1, s1 + s2
    if i < total:
        rising = c <= s1
        scale = c / s1 if rising else (total - c) / s2
        count = stairs[0] if rising else stairs[1]
        if count:
            scale = math.floor(count * (c if rising else total - c) / (s1 if rising else s2))
            scale /= count
        return lo + (hi - lo) * scale, mom[1] - (mom[1] - mom[0]) * scale
    j = i - total + 1
    lr = lo / (1 + rate * j / step) if step and rate else lo
    beta1 = mom[1] * (1 + mom_rate * j / step) if step and mom_rate else mom[1]
    return lr, beta1


@pytest.mark.parametrize(
    "shape",
    [
        {"s1": 4, "s2": 4},
        {"s1": 3, "s2": 7},
        {"s1": 6, "s2": 4, "stairs": (3, 2)},
        {"s1": 4, "s2": 4, "decay": (2, 0.5, 0.1)},
    ],
    ids=["symmetric", "asymmetric", "stairs", "decay"],
)
def test_one_cycle(shape):
    opt = adamw()
    kwargs = {
        "cycle_first_step_size": shape["s1"],
        "cycle_second_step_size": shape["s2"],
        "cycle_first_stair_count": shape.get("stairs", (0, 0))[0],
        "cycle_second_stair_count": shape.get("stairs", (0, 0))[1],
    }
    step, rate, mom_rate = shape.get("decay", (0, 0.0, 0.0))
    s = OneCycle(
        opt,
        cycle_min_lr=0.1,
        cycle_max_lr=1.1,
        decay_step_size=step,
        decay_lr_rate=rate,
        decay_mom_rate=mom_rate,
        **kwargs,
    )
    for i in range(-1, shape["s1"] + shape["s2"] + 6):
        if i >= 0:
            s.step()
        lr, beta1 = one_cycle_at(i, lo=0.1, hi=1.1, **shape)
        group = opt.param_groups[0]
        assert group["lr"] == pytest.approx(lr, rel=1e-12, abs=1e-15), i
        assert group["betas"][0] == pytest.approx(beta1, rel=1e-12), i
        assert group["betas"][1] == 0.999  # beta2 is the optimizer's own


def test_one_cycle_peaks_on_a_stair_boundary_and_without_betas_cycles_lr_only():
    # 3 stairs over a first half of 7: the peak batch sits exactly on the last stair.
    s = OneCycle(adamw(), 0.0, 1.0, cycle_first_step_size=7, cycle_second_step_size=5,
                 cycle_first_stair_count=3)  # fmt: skip
    assert lr_at(s, 6) == 1.0
    with captured_logs() as logs:
        s = OneCycle(sgd(), 0.1, 1.1, cycle_first_step_size=2)
    assert logs == ["WARNING: OneCycle: cycle_momentum is off, since SGD has no betas to cycle"]
    assert lr_at(s, 1) == pytest.approx(1.1) and "betas" not in s.optimizer.param_groups[0]


def test_one_cycle_state_round_trip_sets_lr_and_momentum():
    a = OneCycle(adamw(), 0.1, 1.1, cycle_first_step_size=4)
    for _ in range(3):
        a.step()
    b = OneCycle(adamw(), 0.1, 1.1, cycle_first_step_size=4)
    b.load_state_dict(a.state_dict())
    assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    assert b.optimizer.param_groups[0]["betas"] == a.optimizer.param_groups[0]["betas"]


def test_one_cycle_bad_arguments():
    with pytest.raises(ValueError, match="cycle_first_step_size must be positive"):
        OneCycle(adamw(), 0.1, 1.1, cycle_first_step_size=0)
    with pytest.raises(ValueError, match="cycle_first_stair_count must be a number >= 0"):
        OneCycle(adamw(), 0.1, 1.1, cycle_first_stair_count=-1)
    with pytest.raises(ValueError, match="cycle_min_lr has 1 values for 2 param groups"):
        OneCycle(adamw(lrs=(1.0, 1.0)), [0.1], 1.1)


def one_cycle_through_the_engine() -> list[tuple[float, tuple[float, float]]]:
    import zerolap

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.5, "betas": [0.9, 0.98]}},
        "scheduler": {
            "type": "OneCycle",
            "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 2},
        },
        "zero_optimization": {"stage": 1},
    }
    torch.manual_seed(0)
    engine, optimizer, _, _ = zerolap.initialize(model=torch.nn.Linear(4, 4), config=config)
    seen = []
    for _ in range(6):
        group = optimizer.param_groups[0]
        seen.append((group["lr"], tuple(group["betas"])))
        engine.backward(engine(torch.ones(2, 4)).square().sum())
        engine.step()
    engine.destroy()
    return seen


def test_one_cycle_from_the_config_drives_the_engines_optimizer(ranks):
    seen = ranks(1).run(one_cycle_through_the_engine)[0]
    for i, (lr, betas) in enumerate(seen, start=-1):  # the lr each step ran at
        want_lr, want_beta1 = one_cycle_at(i, lo=0.01, hi=0.1, s1=2, s2=2)
        assert lr == pytest.approx(want_lr, rel=1e-12) and betas[1] == 0.98
        assert betas[0] == pytest.approx(want_beta1, rel=1e-12)


def test_one_cycle_and_range_test_take_deepspeeds_step_argument_and_a_rising_only_cycle():
    s = OneCycle(adamw(), 0.1, 1.1, cycle_first_step_size=4, cycle_second_step_size=0)
    s.step(batch_iteration=2)  # DeepSpeed's keyword (engine.step(lr_kwargs=...) passes it)
    assert s.last_batch_iteration == 2 and s.get_last_lr() == [pytest.approx(0.85)]
    r = LRRangeTest(sgd(), lr_range_test_step_size=2)
    r.step(batch_iteration=3)
    assert r.get_last_lr() == [pytest.approx(1e-3 * 3)]


def test_one_cycle_says_that_beta2_stays_the_optimizers():
    with captured_logs() as logs:
        OneCycle(adamw(), 0.1, 1.1)
    assert logs == [
        "WARNING: OneCycle: beta2 stays the optimizer's (0.999); DeepSpeed's OneCycle sets it "
        "to 0.99 in every group"
    ]
    s = OneCycle(sgd(), 0.1, 1.1, cycle_momentum=False)
    assert s.get_mom() is None
