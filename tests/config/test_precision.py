"""The fp16 and bf16 sections and communication_data_type."""

from __future__ import annotations

import pytest
import torch

from tests.config.helpers import load, load_error


def test_fp16_defaults_follow_deepspeed():
    fp16 = load({"fp16": {"enabled": True}}).fp16
    assert fp16.loss_scale == 0  # dynamic
    assert (fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis) == (16, 1000, 2)
    assert fp16.consecutive_hysteresis is False and fp16.min_loss_scale == 1


def test_fp16_and_bf16_both_enabled_is_an_error():
    message = load_error({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "fp16.enabled, bf16.enabled: fp16 and bf16 cannot both be enabled" in message


def test_bfloat16_is_an_alias_of_bf16():
    config = load({"bfloat16": {"enabled": True}})
    assert config.bf16.enabled and config.precision == "bf16"


def test_bf16_check_overflow_spellings():
    assert load({"bf16": {"check_grad_overflow": True}}).bf16.check_grad_overflow
    assert load({"bf16": {"check_overflow": True}}).bf16.check_grad_overflow


@pytest.mark.parametrize(
    ("section", "precision"), [({}, "fp32"), ({"fp16": {"enabled": True}}, "fp16")]
)
def test_precision(section, precision):
    assert load(section).precision == precision


def test_negative_loss_scale_is_an_error():
    message = load_error({"fp16": {"loss_scale": -1}})
    assert "fp16.loss_scale: got -1; Input should be greater than or equal to 0" in message


def test_master_weights_in_16_bit_are_errors():
    assert "fp16.fp16_master_weights_and_grads: got True" in load_error(
        {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}
    )


def test_bf16_masters_are_checked_by_name():
    both = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    zero = {"zero_optimization": {"stage": 2}}
    assert load({"bf16": {"enabled": True, **both}, **zero}).bf16.bf16_optimizer_states
    message = load_error({"bf16": {"enabled": True, "bf16_optimizer_states": True}, **zero})
    assert "bf16.bf16_master_weights_and_grads, bf16.bf16_optimizer_states: zerolap's" in message
    assert "set both" in message
    message = load_error({"bf16": both, **zero})
    assert "bf16 master weights need bf16 training" in message
    message = load_error({"bf16": {"enabled": True, **both}, "zero_optimization": {"stage": 0}})
    assert "zero_optimization.stage: bf16 master weights are a ZeRO optimizer's" in message
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    message = load_error({"bf16": {"enabled": True, **both}, "zero_optimization": offload})
    assert "zero_optimization.offload_optimizer: zerolap steps bf16 masters only" in message
    offload = {"stage": 3, "offload_param": {"device": "cpu"}}
    message = load_error({"bf16": {"enabled": True, **both}, "zero_optimization": offload})
    assert "zero_optimization.offload_param: zerolap steps bf16 masters only" in message
    for stage in (1, 3):  # offload_param says nothing below stage 3
        zero = {"stage": stage, "offload_param": {"device": "cpu"} if stage == 1 else None}
        assert load({"bf16": {"enabled": True, **both}, "zero_optimization": zero})
    message = load_error({"fp16": {"enabled": True}, "bf16": both, **{"zero_optimization": {}}})
    assert "bf16 master weights need bf16 training" in message


def test_fp16_auto_cast_is_accepted_and_reported_unsupported():
    config = load({"fp16": {"enabled": True, "auto_cast": True}})
    assert config.unsupported_keys() == ["fp16.auto_cast"]


@pytest.mark.parametrize(
    ("spelling", "name", "dtype"),
    [
        ("fp32", "fp32", torch.float32),
        ("FP16", "fp16", torch.float16),
        ("float16", "fp16", torch.float16),
        ("bfloat16", "bf16", torch.bfloat16),
        ("torch.bfloat16", "bf16", torch.bfloat16),
        (None, None, None),
    ],
)
def test_communication_data_type_spellings(spelling, name, dtype):
    config = load({"communication_data_type": spelling})
    assert config.communication_data_type == name
    assert config.communication_dtype == dtype


def test_unknown_communication_data_type_names_the_choices():
    message = load_error({"communication_data_type": "fp8"})
    assert "communication_data_type: got 'fp8'; must be one of fp32, fp16, bf16" in message


def test_an_initial_scale_power_no_float_holds_is_named():
    message = load_error({"fp16": {"enabled": True, "initial_scale_power": 2000}})
    assert "fp16.initial_scale_power: got 2000" in message
