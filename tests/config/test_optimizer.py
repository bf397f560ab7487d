"""The optimizer section: type lookup, parameter checks, DeepSpeed's Adam semantics."""

from __future__ import annotations

import pytest
import torch

from tests.config.helpers import load, load_error


def optimizer(type_, **params):
    return load({"optimizer": {"type": type_, "params": params}}).optimizer


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("adam", "Adam"),
        ("ADAMW", "AdamW"),
        ("Adagrad", "Adagrad"),
        ("LION", "Lion"),
        ("sgd", "SGD"),
        ("RMSprop", "RMSprop"),
    ],
)
def test_type_is_case_insensitive_and_stored_canonically(given, canonical):
    assert optimizer(given).type == canonical


def test_unknown_optimizer_type_names_the_allowed_ones():
    message = load_error({"optimizer": {"type": "Adamm"}})
    assert "optimizer.type: got 'Adamm'; not a DeepSpeed or torch.optim optimizer" in message
    assert "allowed (any case): " in message and "AdamW" in message and "SGD" in message


@pytest.mark.parametrize("name", ["Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Muon"])
def test_deepspeed_optimizers_zerolap_cannot_build_are_errors(name):
    message = load_error({"optimizer": {"type": name}})
    assert f"{name} is a DeepSpeed optimizer zerolap cannot build" in message
    assert "Muon," not in message.split("allowed")[1]


def test_missing_type_is_an_error():
    assert "optimizer.type: required key is missing" in load_error({"optimizer": {"params": {}}})


def test_misspelt_parameter_is_an_error_with_suggestion():
    message = load_error({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentun": 0.9}}})
    assert (
        "optimizer.params.momentun: not an argument of torch.optim.SGD; did you mean momentum?"
        in message
    )


def test_auto_parameter_is_an_error():
    message = load_error({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    assert "optimizer.params.lr: 'auto' is a placeholder" in message


def test_max_grad_norm_points_to_gradient_clipping():
    message = load_error({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}})
    assert "optimizer.params.max_grad_norm" in message and "gradient_clipping" in message


def test_deepspeed_adam_is_adamw_with_zero_weight_decay_by_default():
    cls, kwargs = optimizer(
        "Adam", lr=1e-3, betas=[0.9, 0.95], bias_correction=True
    ).torch_optimizer()
    assert cls is torch.optim.AdamW
    assert kwargs == {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.0}


def test_deepspeed_adam_without_adam_w_mode_is_torch_adam():
    cls, kwargs = optimizer("Adam", adam_w_mode=False, weight_decay=0.1).torch_optimizer()
    assert cls is torch.optim.Adam and kwargs == {"weight_decay": 0.1}


def test_adamw_ignores_adam_w_mode_as_deepspeed_does():
    cls, _ = optimizer("AdamW", adam_w_mode=False).torch_optimizer()
    assert cls is torch.optim.AdamW


def test_bias_correction_off_is_an_error():
    message = load_error({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}})
    assert "optimizer.params.bias_correction: got False" in message


def test_torch_optimizer_builds():
    cls, kwargs = optimizer("sgd", lr=0.1, momentum=0.9).torch_optimizer()
    built = cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)
    assert isinstance(built, torch.optim.SGD) and built.defaults["momentum"] == 0.9


@pytest.mark.parametrize(
    "params, message",
    [
        ({"lr": "fast"}, "optimizer.params.lr: must be a number, got 'fast'"),
        ({"betas": [0.9]}, "optimizer.params.betas: must be two numbers, got [0.9]"),
        ({"weight_decay": True}, "optimizer.params.weight_decay: must be a number, got True"),
    ],
)
def test_bad_argument_values_are_named_before_torch_sees_them(params, message):
    assert message in load_error({"optimizer": {"type": "AdamW", "params": params}})


def test_lion_params_are_checked_against_deepspeeds_lion():
    message = load_error({"optimizer": {"type": "Lion", "params": {"beta": [0.9, 0.99]}}})
    assert "optimizer.params.beta: not an argument of deepspeed.ops.lion.FusedLion" in message
