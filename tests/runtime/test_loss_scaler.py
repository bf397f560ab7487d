"""Loss scales through sequences of overflow / clean updates, as DeepSpeed's scaler gives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zerolap.runtime.loss_scaler import DynamicLossScaler, LossScaler, build_loss_scaler


def scales(scaler: LossScaler, overflows: str) -> list[float]:
    """The scale after each update; ``overflows`` is a string of 'x' (overflow) and '.'."""
    out = []
    for mark in overflows:
        scaler.update_scale(mark == "x")
        out.append(scaler.loss_scale)
    return out


def test_static_scale_ignores_overflow():
    scaler = LossScaler(128.0)
    assert scales(scaler, "x.x..") == [128.0] * 5
    assert not scaler.dynamic


def test_first_growth_after_window_plus_one_clean_updates():
    scaler = DynamicLossScaler(init_scale=8, scale_window=2)
    assert scales(scaler, ".....") == [8, 8, 16, 16, 32]


def test_overflow_shrinks_then_grows_after_window():
    scaler = DynamicLossScaler(init_scale=64, scale_window=3)
    # Overflow at update 0, then the growth needs 3 stable updates after the first clean one.
    assert scales(scaler, "x....") == [32, 32, 32, 32, 64]
    assert scales(scaler, "xx") == [32, 16]


def test_hysteresis_delays_the_shrink_and_is_not_refilled_by_it():
    scaler = DynamicLossScaler(init_scale=64, scale_window=2, delayed_shift=2)
    assert scales(scaler, "x") == [64]
    assert scaler.cur_hysteresis == 1
    # The counter stays at 1 after shrinking, so each further overflow shrinks at once.
    assert scales(scaler, "xx") == [32, 16]
    # A clean update alone does not refill it...
    assert scales(scaler, ".x") == [16, 8]
    # ...the growth after scale_window stable updates does.
    assert scales(scaler, "...") == [8, 8, 16]
    assert scaler.cur_hysteresis == 2
    assert scales(scaler, "x") == [16]


def test_consecutive_hysteresis_refills_on_every_clean_update():
    scaler = DynamicLossScaler(
        init_scale=64, scale_window=100, delayed_shift=2, consecutive_hysteresis=True
    )
    assert scales(scaler, "x.x.x") == [64] * 5
    # Two overflows in a row with no clean update between them shrink.
    assert scales(scaler, "x") == [32]


def test_min_scale_floor_and_error():
    scaler = DynamicLossScaler(init_scale=3, min_scale=1)
    assert scales(scaler, "xx") == [1.5, 1]
    with pytest.raises(RuntimeError, match="already at its minimum 1"):
        scaler.update_scale(True)

    scaler = DynamicLossScaler(init_scale=4, min_scale=2, raise_error_at_min_scale=False)
    assert scales(scaler, "xxx") == [2, 2, 2]


def test_state_round_trip():
    scaler = DynamicLossScaler(init_scale=64, scale_window=3, delayed_shift=2)
    scales(scaler, "x..xx.")
    restored = DynamicLossScaler(init_scale=1, scale_window=3, delayed_shift=2)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    sequence = "...x....xx..."
    assert scales(restored, sequence) == scales(scaler, sequence)


def test_bad_arguments():
    with pytest.raises(ValueError, match="scale_window must be a positive integer"):
        DynamicLossScaler(scale_window=0)
    with pytest.raises(ValueError, match="min_scale must be positive"):
        DynamicLossScaler(min_scale=0)
    with pytest.raises(ValueError, match="scale must be positive and finite"):
        LossScaler(float("inf"))


def fp16_section(**overrides) -> SimpleNamespace:
    fields = dict(
        enabled=True,
        loss_scale=0,
        initial_scale_power=12,
        loss_scale_window=500,
        hysteresis=2,
        consecutive_hysteresis=True,
        min_loss_scale=0.5,
    )
    return SimpleNamespace(**(fields | overrides))


def test_build_loss_scaler():
    scaler = build_loss_scaler(fp16_section())
    assert isinstance(scaler, DynamicLossScaler)
    assert scaler.loss_scale == 2**12
    assert (scaler.scale_window, scaler.min_scale) == (500, 0.5)
    assert (scaler.delayed_shift, scaler.consecutive_hysteresis) == (2, True)

    static = build_loss_scaler(fp16_section(loss_scale=128))
    assert type(static) is LossScaler and static.loss_scale == 128

    disabled = build_loss_scaler(fp16_section(enabled=False))
    assert type(disabled) is LossScaler and disabled.loss_scale == 1.0
