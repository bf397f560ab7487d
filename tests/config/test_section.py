"""Rules every section inherits: unknown keys, double spellings, "auto", unsupported keys."""

from __future__ import annotations

import pytest

from tests.config.helpers import load, load_error
from zerolap.config import ConfigError, ZeroConfig
from zerolap.config.section import nearest_key


def test_unknown_top_level_key_loads_and_is_named_with_the_nearest_valid_key():
    # DeepSpeed ignores unknown top-level keys and real configs carry some: they load, and
    # the engine warns with these words.
    config = load({"zero_optimisation": {"stage": 1}})
    assert config.unknown_keys() == ["zero_optimisation (did you mean zero_optimization?)"]
    assert config.zero_optimization.stage == 0


def test_unknown_nested_key_names_its_dotted_path():
    message = load_error({"zero_optimization": {"stage": 1, "reduce_bucket_sise": 10}})
    assert "zero_optimization.reduce_bucket_sise: unknown key" in message
    assert "did you mean reduce_bucket_size?" in message


def test_unknown_key_two_levels_down():
    message = load_error({"zero_optimization": {"stage": 3, "offload_param": {"devise": "cpu"}}})
    assert "zero_optimization.offload_param.devise: unknown key; did you mean device?" in message


def test_every_unknown_key_of_a_section_is_reported():
    message = load_error({"fp16": {"enabld": True, "loss_scael": 0}})
    assert "fp16.enabld" in message and "fp16.loss_scael" in message
    assert "(2 problems)" in message


def test_unknown_key_without_a_close_match_lists_the_small_section():
    message = load_error({"bf16": {"xyz": 1}})
    assert "bf16.xyz: unknown key; valid keys: enabled," in message


def test_unknown_key_without_a_close_match_at_the_top_level():
    assert load({"qqqqqq": 1}).unknown_keys() == ["qqqqqq"]


def test_unknown_key_with_no_close_match_in_a_small_section_lists_the_valid_keys():
    message = load_error({"bf16": {"qqqqqq": 1}})
    assert "bf16.qqqqqq: unknown key; valid keys: enabled" in message


def test_nearest_key_ignores_case():
    assert nearest_key("Zero_Optimization", ["zero_optimization", "fp16"]) == "zero_optimization"
    assert nearest_key("nothing", ["fp16"]) is None


def test_two_spellings_of_one_key_is_an_error():
    message = load_error({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert "bf16, bfloat16: these keys set the same value; give only bf16" in message


def test_stage3_prefix_and_bare_name_together_is_an_error():
    zero = {"stage": 3, "stage3_max_live_parameters": 1, "max_live_parameters": 2}
    message = load_error({"zero_optimization": zero})
    assert "zero_optimization.stage3_max_live_parameters" in message
    assert "zero_optimization.max_live_parameters" in message


def test_auto_in_a_deepspeed_section_means_the_default():
    zero = {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}
    config = load({"zero_optimization": zero})
    assert config.zero_optimization.reduce_bucket_size == 500_000_000
    assert config.zero_optimization.prefetch_bucket_size == 50_000_000


def test_auto_at_the_top_level_is_an_error_with_a_hint():
    message = load_error({"train_batch_size": "auto"}, base=False)
    assert "train_batch_size: got 'auto'" in message
    assert "Hugging Face Trainer" in message


def test_sections_validate_on_their_own():
    with pytest.raises(ValueError, match="did you mean stage"):
        ZeroConfig.model_validate({"stgae": 1})
    assert ZeroConfig().stage == 0


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_unsupported_keys_skips_values_left_at_default_or_off():
    config = load(
        {
            "wandb": {"enabled": False, "project": "x"},
            "memory_breakdown": False,
            "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1},
        }
    )
    assert config.unsupported_keys() == []


def test_unsupported_keys_names_nested_keys_with_their_deepspeed_spelling():
    zero = {
        "stage": 3,
        "mics_shard_size": 4,
        "stage3_use_all_reduce_for_fetch_params": True,
        "offload_optimizer": {"device": "cpu", "super_offload": True},
    }
    config = load({"zero_optimization": zero})
    assert config.unsupported_keys() == [
        "zero_optimization.offload_optimizer.super_offload",
        "zero_optimization.mics_shard_size",
        "zero_optimization.stage3_use_all_reduce_for_fetch_params",
    ]
