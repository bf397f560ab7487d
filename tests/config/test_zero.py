"""The zero_optimization section and its offload blocks."""

from __future__ import annotations

import pytest

from tests.config.helpers import load, load_error


def zero(**keys):
    return load({"zero_optimization": keys}).zero_optimization


def test_defaults_follow_deepspeed():
    section = zero()
    assert section.stage == 0
    assert section.reduce_scatter is True and section.contiguous_gradients is True
    assert section.reduce_bucket_size == section.allgather_bucket_size == 500_000_000
    assert section.prefetch_bucket_size == 50_000_000
    assert section.param_persistence_threshold == 100_000
    assert section.max_live_parameters == section.max_reuse_distance == 1_000_000_000
    assert section.offload_param is None and section.offload_optimizer is None


@pytest.mark.parametrize(("stage", "expected"), [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_defaults_to_deepspeeds_choice_per_stage(stage, expected):
    assert zero(stage=stage).overlap_comm is expected


def test_overlap_comm_given_is_kept():
    assert zero(stage=3, overlap_comm=False).overlap_comm is False
    assert zero(stage=2, overlap_comm=True).overlap_comm is True


def test_bucket_sizes_accept_floats_and_store_ints():
    section = zero(
        reduce_bucket_size=5e8, allgather_bucket_size=2e8, stage3_prefetch_bucket_size=0.94e6
    )
    assert section.reduce_bucket_size == 500_000_000 and isinstance(section.reduce_bucket_size, int)
    assert section.allgather_bucket_size == 200_000_000
    assert section.prefetch_bucket_size == 940_000


def test_fractional_bucket_size_is_an_error():
    message = load_error({"zero_optimization": {"reduce_bucket_size": 1.5}})
    assert "zero_optimization.reduce_bucket_size: got 1.5" in message


def test_stage3_keys_with_and_without_prefix():
    section = zero(stage=3, stage3_max_live_parameters=7, max_reuse_distance=9)
    assert (section.max_live_parameters, section.max_reuse_distance) == (7, 9)


def test_gather_fp16_weights_is_a_deprecated_spelling():
    section = zero(stage=3, stage3_gather_fp16_weights_on_model_save=True)
    assert section.gather_16bit_weights_on_model_save is True


def test_stage_4_is_an_error():
    message = load_error({"zero_optimization": {"stage": 4}})
    assert "zero_optimization.stage: got 4; the ZeRO stage must be 0, 1, 2 or 3" in message


def test_offload_at_a_stage_that_cannot_use_it_loads_with_advice():
    # DeepSpeed loads these and ignores them; zerolap loads them and the engine warns.
    advice = load({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}).advice()
    assert advice == [
        "zero_optimization.offload_param: ignored at stage 2: parameter offload needs stage 3"
    ]
    advice = load({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    assert advice.advice() == [
        "zero_optimization.offload_optimizer: ignored at stage 0: optimizer offload needs "
        "stage 1, 2 or 3"
    ]
    partial = {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}
    assert load({"zero_optimization": partial}).advice() == []  # ratio works at every stage
    assert (
        zero(stage=3, offload_optimizer=partial["offload_optimizer"]).offload_optimizer.ratio == 0.5
    )
    assert zero(stage=1, offload_optimizer={"device": "cpu"}).offload_optimizer.enabled


def test_offload_param_with_device_none_is_fine_below_stage_3():
    assert zero(stage=2, offload_param={"device": "none"}).offload_param.enabled is False
    assert (
        load({"zero_optimization": {"stage": 2, "offload_param": {"device": "none"}}}).advice()
        == []
    )


@pytest.mark.parametrize("block", ["offload_param", "offload_optimizer"])
def test_nvme_offload_needs_a_path(block, tmp_path):
    message = load_error({"zero_optimization": {"stage": 3, block: {"device": "nvme"}}})
    assert f"zero_optimization.{block}.nvme_path: device 'nvme' needs nvme_path" in message
    section = zero(stage=3, **{block: {"device": "nvme", "nvme_path": str(tmp_path)}})
    assert getattr(section, block).enabled


def test_unknown_offload_device_names_the_choices():
    message = load_error({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}})
    assert "zero_optimization.offload_param.device: got 'gpu'" in message
    assert "'none', 'cpu' or 'nvme'" in message


def test_cpu_offload_is_rewritten_to_offload_optimizer():
    section = zero(stage=2, cpu_offload=True)
    assert section.offload_optimizer.device == "cpu"
    assert zero(stage=2, cpu_offload=False).offload_optimizer is None


def test_cpu_offload_param_is_rewritten_to_offload_param():
    assert zero(stage=3, cpu_offload_param=True).offload_param.device == "cpu"


def test_deprecated_and_current_spelling_together_is_an_error():
    keys = {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}
    message = load_error({"zero_optimization": keys})
    assert "zero_optimization.cpu_offload, zero_optimization.offload_optimizer" in message


@pytest.mark.parametrize(
    "key",
    ["zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights"],
)
def test_quantized_communication_is_an_error(key):
    message = load_error({"zero_optimization": {"stage": 3, key: True}})
    assert f"zero_optimization.{key}: got True; zerolap does not implement this" in message


def test_zenflow_is_an_error():
    message = load_error({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}})
    assert "zero_optimization.zenflow" in message


def test_legacy_boolean_zero_optimization_means_stage_1():
    config = load({"zero_optimization": True, "allgather_size": 1000})
    assert config.zero_optimization.stage == 1
    assert config.zero_optimization.allgather_bucket_size == 1000
    assert load({"zero_optimization": False}).zero_optimization.stage == 0


def test_a_boolean_stage_is_an_error_not_stage_1():
    message = load_error({"zero_optimization": {"stage": True}})
    assert "zero_optimization.stage" in message and "got True" in message
    assert load({"zero_optimization": True}).zero_optimization.stage == 1  # DeepSpeed's old form
