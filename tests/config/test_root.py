"""load_config and ZerolapConfig: files, whole DeepSpeed configs, unsupported keys."""

from __future__ import annotations

import json

import pytest

from tests.config.helpers import load, load_error
from zerolap.config import (
    ActivationCheckpointingConfig,
    CommsLoggerConfig,
    ConfigError,
    FP16Config,
    ZeroConfig,
    ZerolapConfig,
    load_config,
)

# A ZeRO-3 config as found in the wild: fp16 with dynamic loss scaling, offload, stage-3 knobs,
# activation checkpointing, and DeepSpeed features zerolap does not have (profiler, monitors).
REAL_WORLD = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "steps_per_print": 2000,
    "gradient_clipping": 1.0,
    "wall_clock_breakdown": False,
    "prescale_gradients": False,
    "zero_allow_untested_optimizer": True,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-5, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500},
    },
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 1e6,
        "stage3_prefetch_bucket_size": 0.94e6,
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "flops_profiler": {
        "enabled": True,
        "profile_step": 1,
        "module_depth": -1,
        "top_modules": 1,
        "detailed": True,
        "output_file": None,
    },
    "tensorboard": {"enabled": True, "output_path": "logs/", "job_name": "run"},
    "wandb": {"enabled": False},
    "activation_checkpointing": {
        "partition_activations": False,
        "cpu_checkpointing": False,
        "contiguous_memory_optimization": False,
        "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    },
    "comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": False},
}


def test_real_world_config_loads_with_every_key_read():
    config = load_config(REAL_WORLD, world_size=8)
    assert config.unsupported_keys() == []  # every key of this real config is read
    assert config.precision == "fp16" and config.fp16.loss_scale == 0
    zero = config.zero_optimization
    assert zero.stage == 3 and zero.prefetch_bucket_size == 940_000
    assert zero.offload_param.device == "cpu" and zero.offload_optimizer.pin_memory
    assert config.flops_profiler.enabled and config.flops_profiler.module_depth == -1
    assert config.tensorboard.enabled and config.tensorboard.job_name == "run"
    assert config.optimizer.type == "AdamW" and config.scheduler.type == "WarmupLR"
    assert config.comms_logger.enabled


def test_components_receive_typed_sections():
    config = load_config(REAL_WORLD, world_size=8)
    assert isinstance(config.zero_optimization, ZeroConfig)
    assert isinstance(config.fp16, FP16Config)
    assert isinstance(config.comms_logger, CommsLoggerConfig)
    assert isinstance(config.activation_checkpointing, ActivationCheckpointingConfig)


def test_defaults_follow_deepspeed():
    config = load()
    # DeepSpeed 0.19.8's: clipping at 1.0, no progress lines.
    assert config.steps_per_print is None and config.gradient_clipping == 1.0
    assert config.gradient_predivide_factor == 1.0 and config.prescale_gradients is False
    assert config.communication_data_type is None and config.precision == "fp32"
    assert config.optimizer is None and config.scheduler is None
    assert config.timers.throughput.enabled and config.timers.throughput.synchronized


def test_the_throughput_timer_section_is_checked():
    assert load({"timers": {"throughput": {"enabled": False}}}).timers.throughput.enabled is False
    assert "timers.throughput.enabld" in load_error({"timers": {"throughput": {"enabld": False}}})


def test_json_file_loads(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(REAL_WORLD))
    assert load_config(path, world_size=8) == load_config(str(path), world_size=8)
    assert load_config(path, world_size=8).train_batch_size == 64


def test_errors_from_a_file_name_the_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "fp16": {"enabled": "maybe"}}))
    with pytest.raises(ConfigError) as error:
        load_config(path, world_size=1)
    assert str(path) in str(error.value)
    assert "fp16.enabled: got 'maybe'; Input should be a valid boolean" in str(error.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read ds_config"):
        load_config(tmp_path / "absent.json", world_size=1)


def test_invalid_json_is_a_config_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8,}')
    with pytest.raises(ConfigError, match=r"is not valid JSON: .* line 1"):
        load_config(path, world_size=1)


def test_duplicate_keys_in_a_file_are_an_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "fp16": {"enabled": true, "enabled": false}}')
    with pytest.raises(ConfigError, match="duplicate keys enabled"):
        load_config(path, world_size=1)


def test_a_non_object_config_is_an_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object; got list"):
        load_config(path, world_size=1)


@pytest.mark.parametrize("world_size", [0, -1, 1.0, True])
def test_bad_world_size_is_an_error(world_size):
    with pytest.raises(ConfigError, match="world_size must be a positive int"):
        load_config({"train_batch_size": 8}, world_size=world_size)


def test_wrong_type_names_the_dotted_key_and_the_value():
    message = load_error({"zero_optimization": {"stage": "three"}})
    assert "zero_optimization.stage: got 'three'; Input should be a valid integer" in message


def test_wrong_type_for_a_whole_section():
    message = load_error({"fp16": True})
    assert "fp16: got True; Input should be a valid dictionary" in message


def test_problems_in_several_sections_are_collected_in_one_error():
    message = load_error(
        {
            "gradient_clipping": -1,
            "fp16": {"hysteresis": 0},
            "zero_optimization": {"stage": 9},
            "comms_logger": {"verbos": True},
        }
    )
    assert "(4 problems)" in message
    for key in (
        "gradient_clipping",
        "fp16.hysteresis",
        "zero_optimization.stage",
        "comms_logger.verbos",
    ):
        assert f"  - {key}:" in message


def test_the_original_dict_is_not_modified():
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": True}}
    load_config(config, world_size=1)
    assert config == {"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": True}}


def test_model_validate_without_world_size_leaves_the_triangle_alone():
    config = ZerolapConfig.model_validate({"train_batch_size": 8})
    assert config.train_micro_batch_size_per_gpu is None


def test_what_the_hugging_face_clients_hand_over_loads():
    # Accelerate writes steps_per_print inf; TRL adds dotted top-level keys DeepSpeed ignores.
    config = load(
        {
            "steps_per_print": float("inf"),
            "zero_optimization.reduce_bucket_size": 4096,
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
        }
    )
    assert config.print_interval is None and config.zero_optimization.reduce_bucket_size == 5e8
    assert config.unknown_keys() == [
        "zero_optimization.reduce_bucket_size (did you mean zero_optimization?)"
    ]
    assert load({"steps_per_print": 2.5}).print_interval == 2
    assert load({"steps_per_print": 0}).print_interval is None


def test_deepspeed_0_19_8_zero_keys_load():
    keys = {"compute_grad_norm": False, "parameter_alignment": True}
    zero = load({"gradient_clipping": 0.0, "zero_optimization": keys})
    assert zero.zero_optimization.compute_grad_norm is False
    assert zero.unsupported_keys() == ["zero_optimization.parameter_alignment"]


def test_no_gradient_norm_means_no_clipping():
    message = load_error({"zero_optimization": {"compute_grad_norm": False}})
    assert "zero_optimization.compute_grad_norm, gradient_clipping" in message
    config = load({"gradient_clipping": 0, "zero_optimization": {"compute_grad_norm": False}})
    assert config.zero_optimization.compute_grad_norm is False


def test_leaf_module_section():
    zero = load({"zero_optimization": {"leaf_module": {"names": "moe", "classes": []}}})
    assert zero.zero_optimization.leaf_module.names == ["moe"]
    assert zero.zero_optimization.leaf_module.classes == []
    default = load().zero_optimization.leaf_module.classes
    assert any(name.endswith("MixtralSparseMoeBlock") for name in default)


def test_data_parallel_size_must_match_the_job():
    config = {"train_micro_batch_size_per_gpu": 1, "data_parallel_size": 2}
    assert load_config(config, world_size=2).data_parallel_size == 2
    with pytest.raises(ConfigError, match=r"data_parallel_size: 4 data-parallel copies asked"):
        load_config({**config, "data_parallel_size": 4}, world_size=2)
