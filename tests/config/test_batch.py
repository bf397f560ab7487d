"""The batch-size triangle, resolved as DeepSpeed does."""

from __future__ import annotations

import pytest

from tests.config.helpers import load_error
from zerolap.config import BatchSize, load_config, resolve_batch_size


def resolve(train=None, micro=None, steps=None, world_size=4) -> BatchSize:
    return resolve_batch_size(
        train_batch_size=train,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=steps,
        world_size=world_size,
    )


def test_all_three_consistent():
    assert resolve(32, 4, 2) == BatchSize(32, 4, 2)


def test_all_three_inconsistent_shows_all_four_numbers():
    with pytest.raises(ValueError) as error:
        resolve(32, 3, 2)
    message = str(error.value)
    for part in (
        "train_batch_size=32",
        "per_gpu=3",
        "gradient_accumulation_steps=2",
        "world_size=4",
    ):
        assert part in message
    assert "(= 24)" in message


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ((32, 4, None), BatchSize(32, 4, 2)),  # train and micro: derive accumulation
        ((32, None, 2), BatchSize(32, 4, 2)),  # train and accumulation: derive micro
        ((None, 4, 2), BatchSize(32, 4, 2)),  # micro and accumulation: derive train
        ((32, None, None), BatchSize(32, 8, 1)),  # only train: one accumulation step
        ((None, 4, None), BatchSize(16, 4, 1)),  # only micro: one accumulation step
    ],
)
def test_derivations(given, expected):
    assert resolve(*given) == expected


@pytest.mark.parametrize(
    ("given", "derived", "divisor"),
    [
        ((30, 4, None), "gradient_accumulation_steps", "(= 16)"),
        ((30, None, 2), "train_micro_batch_size_per_gpu", "(= 8)"),
        ((30, None, None), "train_micro_batch_size_per_gpu", "(= 4)"),
    ],
)
def test_derivations_that_do_not_divide_are_errors(given, derived, divisor):
    with pytest.raises(ValueError) as error:
        resolve(*given)
    message = str(error.value)
    assert f"cannot derive {derived}" in message
    assert "train_batch_size=30" in message and "world_size=4" in message and divisor in message


def test_none_given_is_an_error():
    with pytest.raises(ValueError, match="give train_batch_size or train_micro_batch_size_per_gpu"):
        resolve(None, None, 2)


def test_non_positive_values_are_errors():
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        resolve(8, world_size=0)
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be at least 1"):
        resolve(8, 1, 0)


def test_load_config_resolves_the_triangle_for_its_world_size():
    config = load_config(
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, world_size=4
    )
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu) == (24, 2)
    assert config.gradient_accumulation_steps == 3


def test_load_config_inconsistency_names_the_keys_and_all_four_numbers():
    config = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
    }
    message = load_error(config, world_size=4, base=False)
    assert (
        "train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps:" in message
    )
    assert "train_batch_size=32" in message and "world_size=4" in message and "(= 24)" in message


def test_load_config_without_any_batch_size_is_an_error():
    message = load_error({"gradient_accumulation_steps": 2}, base=False)
    assert "give train_batch_size or train_micro_batch_size_per_gpu" in message


def test_zero_batch_size_is_a_field_error():
    message = load_error({"train_batch_size": 0}, base=False)
    assert "train_batch_size: got 0; Input should be greater than or equal to 1" in message
