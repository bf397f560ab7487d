"""The scheduler section."""

from __future__ import annotations

import pytest
import torch

from tests.config.helpers import load, load_error


def scheduler(type_, **params):
    return load({"scheduler": {"type": type_, "params": params}}).scheduler


@pytest.mark.parametrize("name", ["WarmupLR", "warmupdecaylr", "WARMUPCOSINELR"])
def test_deepspeed_schedules_are_accepted_in_any_case(name):
    params = {} if name == "WarmupLR" else {"total_num_steps": 100}
    section = scheduler(name, **params)
    assert section.type.lower() == name.lower() and section.torch_class is None


def test_onecycle_and_range_test_are_accepted_with_their_arguments():
    section = scheduler("onecycle", cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_momentum=False)
    assert section.type == "OneCycle" and section.torch_class is None
    section = scheduler("LRRANGETEST", lr_range_test_step_size=10)
    assert section.type == "LRRangeTest"
    message = load_error({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 1.0}}})
    assert "scheduler.params.cycle_min_lr: OneCycle needs this argument" in message
    params = {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_stepsize": 5}
    message = load_error({"scheduler": {"type": "OneCycle", "params": params}})
    assert "did you mean cycle_first_step_size?" in message


def test_torch_schedulers_are_accepted_as_deepspeed_does():
    section = scheduler("steplr", step_size=10)
    assert section.type == "StepLR" and section.torch_class is torch.optim.lr_scheduler.StepLR


def test_unknown_scheduler_type_is_an_error():
    message = load_error({"scheduler": {"type": "Warmup"}})
    assert "scheduler.type: got 'Warmup'; not a DeepSpeed or torch schedule" in message
    assert "WarmupLR" in message


def test_misspelt_and_missing_parameters_are_errors():
    params = {"warmup_num_step": 10, "warmup_type": "cosine"}
    message = load_error({"scheduler": {"type": "WarmupDecayLR", "params": params}})
    assert "scheduler.params.warmup_num_step: not an argument of WarmupDecayLR" in message
    assert "did you mean warmup_num_steps?" in message
    assert "scheduler.params.total_num_steps: WarmupDecayLR needs this argument" in message
    assert "scheduler.params.warmup_type: got 'cosine'; must be one of log, linear" in message


def test_auto_parameter_is_an_error():
    message = load_error({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}})
    assert "scheduler.params.warmup_max_lr: 'auto' is a placeholder" in message
