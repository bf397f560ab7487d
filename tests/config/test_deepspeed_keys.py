"""Top-level DeepSpeed keys: those zerolap accepts without implementing them, and small ones it
reads (the checkpoint section, the vocabulary size)."""

from __future__ import annotations

import pytest

from tests.config.helpers import load, load_error

ACCEPTED = {
    "aio": {"block_size": 1048576},
    "autotuning": {"enabled": True},
    "hybrid_engine": {"enabled": True},
    "compile": {"deepcompile": True},
    "seed": 1234,
    "disable_allgather": True,
    "graph_harvesting": True,
    "use_data_before_expert_parallelism": True,
}


def test_deepspeed_only_keys_are_accepted_stored_and_reported():
    config = load(ACCEPTED)
    assert sorted(config.unsupported_keys()) == sorted(ACCEPTED)
    assert config.autotuning == {"enabled": True}  # stored as given
    assert config.seed == 1234


def test_checkpoint_section_checks_its_tag_mode_and_names_storage_options():
    config = load({"checkpoint": {"tag_validation": "fail", "use_node_local_storage": True}})
    assert config.checkpoint.tag_validation == "FAIL"
    assert config.unsupported_keys() == ["checkpoint.use_node_local_storage"]
    assert load({"checkpoint": {"load_universal": True}}).unsupported_keys() == []
    assert "checkpoint.tag_validation" in load_error({"checkpoint": {"tag_validation": "Maybe"}})
    assert "checkpoint.tag_validaton" in load_error({"checkpoint": {"tag_validaton": "Warn"}})


def test_a_vocabulary_size_off_the_multiples_of_8_is_advised():
    assert load({"vocabulary_size": 50304}).advice() == []
    (note,) = load({"vocabulary_size": 50257}).advice()
    assert note.startswith("vocabulary_size: 50257 is not a multiple of 8")


def test_disabled_features_are_not_reported():
    config = load({"amp": {"enabled": False}, "sparse_gradients": False, "elasticity": {}})
    assert config.unsupported_keys() == []


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("amp", {"enabled": True, "opt_level": "O1"}),
        ("sparse_gradients", True),
        ("progressive_layer_drop", {"enabled": True, "theta": 0.5}),
        ("curriculum_learning", {"enabled": True}),
        ("data_efficiency", {"enabled": True}),
        ("compression_training", {"weight_quantization": {"shared_parameters": {"enabled": True}}}),
        ("elasticity", {"enabled": True}),
        ("sequence_parallel_size", 2),
        ("gradient_allreduce_op", "SUM"),
        ("managed_gradient_accumulation", False),
    ],
)
def test_values_that_would_change_the_results_are_errors(key, value):
    message = load_error({key: value})
    assert f"  - {key}: got " in message and "zerolap does not implement this" in message


def test_gradient_allreduce_op_mean_is_fine():
    assert load({"gradient_allreduce_op": "Mean"}).gradient_allreduce_op == "mean"


def test_pipeline_section_is_read_not_merely_accepted():
    config = load({"pipeline": {"stages": 2, "partition": "uniform", "seed_layers": True}})
    assert "pipeline" not in config.unsupported_keys()
    assert (config.pipeline.stages, config.pipeline.partition) == (2, "uniform")
    assert config.pipeline.seed_layers is True
    assert "pipeline.stages" in load_error({"pipeline": {"stages": "two"}})


def test_deepspeeds_own_tensor_parallel_keys_load():
    # DeepSpeed's AutoTP section spells these out; at their defaults they change nothing,
    # those with no effect here are reported, and those that would change what runs refused.
    section = {
        "autotp_size": 2,
        "tp": {"tp_size": 2, "tp_grain_size": 1},
        "keep_module_on_host": True,
        "dtype": "bf16",
        "vocab_parallel_lm_head": False,
        "kernel_inject": False,
        "injection_policy_tuple": None,
    }
    config = load({"tensor_parallel": section}, world_size=2)
    assert sorted(config.unsupported_keys()) == [
        "tensor_parallel.dtype",
        "tensor_parallel.keep_module_on_host",
    ]
    tp = {"autotp_size": 2, "tp": {"tp_size": 4}}
    message = load_error({"tensor_parallel": tp}, world_size=2)
    assert "tensor_parallel.tp: tp_size 4 does not match autotp_size (2)" in message
    message = load_error(
        {"tensor_parallel": {"autotp_size": 2, "kernel_inject": True}}, world_size=2
    )
    assert "tensor_parallel.kernel_inject: got True; zerolap does not implement this" in message
    head = {"autotp_size": 2, "vocab_parallel_lm_head": True}
    message = load_error({"tensor_parallel": head}, world_size=2)
    assert "tensor_parallel.vocab_parallel_lm_head: true is not implemented" in message
