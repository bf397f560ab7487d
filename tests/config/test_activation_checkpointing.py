"""The ``activation_checkpointing`` section: DeepSpeed's keys and defaults, and the rule between
keys, which holds once the settings are in force."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tests.config.helpers import load, load_error
from zerolap.config import ActivationCheckpointingConfig
from zerolap.config.activation_checkpointing import IN_FORCE

ALL_KEYS = {
    "partition_activations": True,
    "cpu_checkpointing": True,
    "contiguous_memory_optimization": True,
    "number_checkpoints": 12,
    "synchronize_checkpoint_boundary": True,
    "profile": True,
}


def test_defaults_follow_deepspeed():
    section = load().activation_checkpointing
    assert section.model_dump() == {
        "partition_activations": False,
        "cpu_checkpointing": False,
        "contiguous_memory_optimization": False,
        "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    }


def test_every_key_loads_and_none_is_reported_unsupported():
    config = load({"activation_checkpointing": ALL_KEYS})
    assert config.activation_checkpointing.model_dump() == ALL_KEYS
    assert config.unsupported_keys() == []


def test_number_checkpoints_must_be_positive():
    message = load_error({"activation_checkpointing": {"number_checkpoints": 0}})
    assert "activation_checkpointing.number_checkpoints: got 0" in message


def test_contiguous_memory_without_number_checkpoints_loads_but_is_not_in_force():
    # DeepSpeed's loader accepts it (Megatron passes configure(num_checkpoints=...)); DeepSpeed
    # asserts it where the settings go into force, and so does zerolap.
    settings = {"contiguous_memory_optimization": True}
    assert load({"activation_checkpointing": settings})
    with pytest.raises(ValidationError) as error:
        ActivationCheckpointingConfig.model_validate(settings, context=IN_FORCE)
    assert "contiguous_memory_optimization, number_checkpoints: " in str(error.value)
    settings["number_checkpoints"] = 4
    assert ActivationCheckpointingConfig.model_validate(settings, context=IN_FORCE)
