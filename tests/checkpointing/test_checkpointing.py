"""``zerolap.checkpointing``: checkpointed calls give exactly the uncheckpointed gradients;
``configure`` reads a ds_config, a JSON path or a parsed config, keywords win; profiling logs."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.checkpointing.blocks import Block, assert_same, fresh_state, gradients
from zerolap import checkpointing
from zerolap.config import ActivationCheckpointingConfig, ConfigError, load_config
from zerolap.utils.logging import logger


@pytest.fixture(autouse=True)
def unconfigured():
    with fresh_state():
        yield


def _plain(block, *args):
    return block(*args)


def _checkpointed(block, *args):
    return checkpointing.checkpoint(block, *args)


def _non_reentrant(block, *args):
    return checkpointing.non_reentrant_checkpoint(block, *args)


def _inputs(x_requires_grad: bool = True):
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 8, requires_grad=x_requires_grad)
    bias = torch.randn(4, 8)  # an input that does not require grad
    return block, x, bias


@pytest.mark.parametrize("run", [_checkpointed, _non_reentrant])
def test_gradients_equal_the_uncheckpointed_block_exactly(run):
    block, x, bias = _inputs()
    assert_same(gradients(_plain, block, x, bias), gradients(run, block, x, bias))


def test_without_restoring_the_tracker_the_gradients_differ(monkeypatch):
    # The check above can fail: a recompute that draws from the tracker's advanced state differs.
    block, x, bias = _inputs()
    expected = gradients(_plain, block, x, bias)
    monkeypatch.setattr(checkpointing.CudaRNGStatesTracker, "set_states", lambda self, s: None)
    with pytest.raises(AssertionError):
        assert_same(expected, gradients(_checkpointed, block, x, bias))


def test_non_reentrant_gives_parameter_gradients_without_inputs_requiring_grad():
    block, x, bias = _inputs(x_requires_grad=False)
    expected = gradients(_plain, block, x, bias)
    assert_same(expected, gradients(_non_reentrant, block, x, bias))
    assert expected[1]["inner.weight"] is not None


def test_tensors_passed_by_keyword_get_gradients():
    torch.manual_seed(0)
    x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    out = checkpointing.checkpoint(lambda a, b=None, power=1: (a * b) ** power, x, b=y, power=2)
    out.sum().backward()
    assert torch.allclose(x.grad, 2 * x * y * y) and torch.allclose(y.grad, 2 * y * x * x)


def test_checkpoint_function_apply_fills_all_outputs():
    x = torch.ones(2, requires_grad=True)
    all_outputs: list = []
    tensors = checkpointing.CheckpointFunction.apply(lambda t: (t * 2, "tag"), all_outputs, x)
    assert len(tensors) == 1 and all_outputs[1] == "tag"
    tensors[0].sum().backward()
    assert torch.equal(x.grad, torch.full((2,), 2.0))


def test_configure_marks_configured_and_reset_keeps_it():
    assert not checkpointing.is_configured()
    checkpointing.configure_from_config(ActivationCheckpointingConfig(profile=True))
    assert not checkpointing.is_configured()  # the engine's call is not the user's opt-in
    checkpointing.configure(None)
    assert checkpointing.is_configured()
    checkpointing.reset()
    assert checkpointing.is_configured()


DS_CONFIG = {
    "train_batch_size": 8,
    "activation_checkpointing": {"cpu_checkpointing": True, "profile": True},
}


def _in_force() -> ActivationCheckpointingConfig:
    return checkpointing._STATE.config


def test_configure_from_a_dict_a_json_path_and_a_parsed_config(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DS_CONFIG))
    for source in (DS_CONFIG, path, str(path), load_config(DS_CONFIG, world_size=1)):
        checkpointing.configure(None)
        assert not _in_force().profile
        checkpointing.configure(None, deepspeed_config=source)
        assert _in_force().profile and _in_force().cpu_checkpointing, source


def test_keywords_override_the_ds_config():
    checkpointing.configure(
        None, deepspeed_config=DS_CONFIG, profile=False, synchronize=True, num_checkpoints=3
    )
    config = _in_force()
    assert config.cpu_checkpointing and not config.profile
    assert config.synchronize_checkpoint_boundary and config.number_checkpoints == 3


def test_contiguous_memory_needs_number_checkpoints_when_put_in_force():
    with pytest.raises(ConfigError) as error:
        checkpointing.configure(None, contiguous_checkpointing=True)
    assert "contiguous_memory_optimization, number_checkpoints: " in str(error.value)
    block = {"activation_checkpointing": {"contiguous_memory_optimization": True}}
    with pytest.raises(ConfigError, match="contiguous_memory_optimization, number_checkpoints"):
        checkpointing.configure(None, deepspeed_config=block)
    # Megatron's way: the count comes from configure's keyword; DeepSpeed loads such a ds_config.
    checkpointing.configure(None, deepspeed_config=block, num_checkpoints=4)
    assert _in_force().contiguous_memory_optimization and _in_force().number_checkpoints == 4
    assert load_config({**block, "train_batch_size": 8}, world_size=1)


def test_a_misspelt_key_in_the_block_is_an_error():
    config = {"activation_checkpointing": {"partitioned_activations": True}}
    with pytest.raises(ConfigError) as error:
        checkpointing.configure(None, deepspeed_config=config)
    message = str(error.value)
    assert "activation_checkpointing.partitioned_activations: unknown key" in message
    assert "did you mean partition_activations?" in message


def test_deepspeed_config_of_another_type_is_an_error():
    with pytest.raises(TypeError, match="takes a ds_config dict, a JSON path"):
        checkpointing.configure(None, deepspeed_config=42)


def _square(x):
    return x * x


def test_profile_logs_forward_and_recompute_times():
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        checkpointing.configure(None, profile=True)
        x = torch.ones(3, requires_grad=True)
        checkpointing.checkpoint(_square, x).sum().backward()
    finally:
        logger.removeHandler(handler)
    messages = [record.getMessage() for record in records]
    assert any("activation checkpoint forward of _square: " in m and " ms" in m for m in messages)
    assert any("activation checkpoint recompute of _square: " in m for m in messages)


def test_partition_activations_without_model_parallelism_is_a_no_op():
    checkpointing.configure(None, partition_activations=True)
    assert checkpointing._STATE.store is None  # inputs saved exactly as torch saves them
    block, x, bias = _inputs()
    assert_same(gradients(_plain, block, x, bias), gradients(_checkpointed, block, x, bias))
