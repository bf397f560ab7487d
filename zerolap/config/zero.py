"""The ``zero_optimization`` section: which ZeRO stage, bucket sizes, overlap, offload, and the
stage-3 parameter-fetching knobs.

Keys follow DeepSpeed's spellings and defaults. Stage-3 keys are accepted both with and without
their ``stage3_`` prefix, as in DeepSpeed. Deprecated spellings are rewritten: ``cpu_offload:
true`` becomes ``offload_optimizer: {device: cpu}``, ``cpu_offload_param: true`` becomes
``offload_param: {device: cpu}``, and ``stage3_gather_fp16_weights_on_model_save`` sets
``stage3_gather_16bit_weights_on_model_save``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AliasChoices, Field, field_validator

from zerolap.config.errors import Problem, problems_error
from zerolap.config.leaf_module import LeafModuleConfig
from zerolap.config.offload import OffloadOptimizerConfig, OffloadParamConfig
from zerolap.config.section import ConfigSection, DeepSpeedOnly, is_set, is_true

__all__ = ["ZeroConfig"]

_QUANTIZED = "quantised communication changes the numerics"
_DEPRECATED = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


def _stage3(name: str) -> AliasChoices:
    return AliasChoices(f"stage3_{name}", name)


class ZeroConfig(ConfigSection):
    """The ``zero_optimization`` section."""

    stage: int = 0
    """0: plain data parallelism; 1: shard optimizer state; 2: also gradients; 3: also
    parameters."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced."""
    reduce_scatter: bool = True
    """Reduce gradients with reduce-scatter (each rank keeps its shard) rather than all-reduce."""
    reduce_bucket_size: int = Field(500_000_000, ge=0)
    """Gradient elements reduced per bucket."""
    allgather_partitions: bool = True
    """Gather updated parameter shards with all-gather rather than a series of broadcasts."""
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    """Parameter elements all-gathered per bucket after the optimizer step."""
    overlap_param_gather: bool = True
    """Stages 1-2 (zerolap's own key, Megatron's name): leave the all-gather of updated
    parameters in flight when ``step()`` ends, each bucket waited by the forward pre-hook of
    the first module that uses it; any other read of a parameter waits for all of them first.
    False waits at the end of ``step()``, as DeepSpeed does."""
    overlap_comm: bool | None = None
    """Overlap gradient reduction with the backward pass. Unset means DeepSpeed's default: on for
    stage 3, off otherwise; after loading it is always a bool."""
    load_from_fp32_weights: bool = True
    """On checkpoint load, initialise fp32 master weights from the saved fp32 copies."""
    offload_param: OffloadParamConfig | None = None
    """Keep parameter shards in CPU memory (stage 3 only)."""
    offload_optimizer: OffloadOptimizerConfig | None = None
    """Keep the optimizer state shard (and fp32 master) in host memory or on disk, and step
    there (stages 1-3)."""
    sub_group_size: int = Field(1_000_000_000, ge=0)
    """Optimizer elements per sub-group: the optimizer steps a rank's elements one sub-group at
    a time, and an offloaded sub-group is what is brought in and written back at once (0: every
    run of one parameter group and bucket is its own). Exact here; DeepSpeed rounds up to whole
    parameters."""
    prefetch_bucket_size: int = Field(
        50_000_000, ge=0, validation_alias=_stage3("prefetch_bucket_size")
    )
    """Stage 3: parameter elements fetched ahead of their use."""
    param_persistence_threshold: int = Field(
        100_000, ge=0, validation_alias=_stage3("param_persistence_threshold")
    )
    """Stage 3: parameters with fewer elements than this stay whole on every rank."""
    model_persistence_threshold: int = Field(
        2**63 - 1, ge=0, validation_alias=_stage3("model_persistence_threshold")
    )
    """Stage 3: upper bound on the elements kept whole by ``param_persistence_threshold``."""
    max_live_parameters: int = Field(
        1_000_000_000, ge=0, validation_alias=_stage3("max_live_parameters")
    )
    """Stage 3: gathered parameter elements allowed per rank before releasing some."""
    max_reuse_distance: int = Field(
        1_000_000_000, ge=0, validation_alias=_stage3("max_reuse_distance")
    )
    """Stage 3: keep a gathered parameter if it is used again within this many elements."""
    gather_16bit_weights_on_model_save: bool = Field(
        False,
        validation_alias=AliasChoices(
            "stage3_gather_16bit_weights_on_model_save",
            "gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
        ),
    )
    """Stage 3: gather full 16-bit weights when saving the model."""
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """Stage 3: modules gathered whole with their subtree (mixture-of-experts blocks)."""
    module_granularity_threshold: int = Field(
        0, ge=0, validation_alias=_stage3("module_granularity_threshold")
    )
    """Stage 3: modules whose *granularity* (DeepSpeed's measure: the parameter elements of
    the subtree over the modules in it) is at most this are gathered whole, as leaves, with one
    collective and one pair of hooks instead of one per child (``zero.leaf_modules``). 0: off.
    """
    compute_grad_norm: bool = True
    """Compute the global gradient norm at every step (for clipping and
    ``engine.get_global_grad_norm()``); false saves its all-reduce and needs
    ``gradient_clipping`` 0."""
    ignore_unused_parameters: bool = True
    """Tolerate parameters that get no gradient; false makes them an error."""

    # Accepted for DeepSpeed compatibility; zerolap does not implement these.
    zero_quantized_weights: Annotated[bool, DeepSpeedOnly(is_true, _QUANTIZED)] = False
    """ZeRO++: all-gather quantised weights."""
    zero_quantized_nontrainable_weights: Annotated[bool, DeepSpeedOnly(is_true, _QUANTIZED)] = False
    """ZeRO++: store frozen weights quantised."""
    zero_quantized_gradients: Annotated[bool, DeepSpeedOnly(is_true, _QUANTIZED)] = False
    """ZeRO++: reduce quantised gradients."""
    zenflow: Annotated[
        dict[str, Any] | None,
        DeepSpeedOnly(is_set, "ZenFlow defers some gradient updates"),
    ] = None
    """DeepSpeed's ZenFlow: asynchronous updates of less important gradients."""
    zero_hpz_partition_size: Annotated[int, DeepSpeedOnly()] = Field(1, ge=0)
    """ZeRO++: ranks in the secondary (hierarchical) parameter shard group."""
    zeropp_loco_param: Annotated[dict[str, Any] | None, DeepSpeedOnly()] = None
    """ZeRO++: LoCo error feedback for quantised gradients."""
    mics_shard_size: Annotated[int, DeepSpeedOnly()] = -1
    """MiCS: shard within groups of this many ranks."""
    mics_hierarchical_params_gather: Annotated[bool, DeepSpeedOnly()] = False
    """MiCS: gather parameters hierarchically."""
    use_multi_rank_bucket_allreduce: Annotated[bool, DeepSpeedOnly()] = True
    """DeepSpeed merges the reduce buckets of several ranks into one all-reduce."""
    round_robin_gradients: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed spreads gradient copies to CPU across ranks (stages 1-2 with offload)."""
    elastic_checkpoint: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed's legacy elastic checkpoint format."""
    legacy_stage1: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed's old stage-1 implementation."""
    cpu_offload_use_pin_memory: Annotated[bool | None, DeepSpeedOnly()] = None
    """Deprecated DeepSpeed key; use ``pin_memory`` in the offload sections."""
    memory_efficient_linear: Annotated[bool, DeepSpeedOnly()] = True
    """DeepSpeed's stage-3 linear layer that does not keep gathered weights for backward."""
    override_module_apply: Annotated[bool, DeepSpeedOnly()] = True
    """DeepSpeed gathers stage-3 parameters around ``nn.Module.apply``."""
    pipeline_loading_checkpoint: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed loads stage-3 checkpoints in pipeline mode."""
    log_trace_cache_warnings: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed logs its stage-3 trace-cache invalidations."""
    enable_sanity_checks: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed's internal stage-3 sanity checks."""
    save_muon_momentum_buffer_in_memory: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed keeps Muon's momentum in memory when swapping to NVMe."""
    use_all_reduce_for_fetch_params: Annotated[bool, DeepSpeedOnly()] = Field(
        False, validation_alias=_stage3("use_all_reduce_for_fetch_params")
    )
    """DeepSpeed fetches stage-3 parameters with all-reduce."""
    allgather_sequential: Annotated[bool, DeepSpeedOnly()] = Field(
        False, validation_alias=_stage3("allgather_sequential")
    )
    """DeepSpeed gathers stage-3 parameters one by one, without buckets."""
    parameter_alignment: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed aligns each parameter's start in its flat buffers; zerolap's layout is its own
    and the results do not depend on it."""
    partition_stream_chunk_size: Annotated[int, DeepSpeedOnly()] = Field(
        0, ge=0, validation_alias=_stage3("partition_stream_chunk_size")
    )
    """DeepSpeed shards huge parameters through chunks of this many elements."""

    @field_validator("stage", mode="before")
    @classmethod
    def _not_a_bool(cls, stage: Any) -> Any:
        # A bool is an int to Python; "stage: true" is a typo for a number, not stage 1.
        if isinstance(stage, bool):
            raise ValueError("the ZeRO stage is a number, 0, 1, 2 or 3")
        return stage

    @field_validator("stage")
    @classmethod
    def _known_stage(cls, stage: int) -> int:
        if stage not in (0, 1, 2, 3):
            raise ValueError("the ZeRO stage must be 0, 1, 2 or 3")
        return stage

    @classmethod
    def _rewrite_legacy(cls, data: dict[str, Any]) -> dict[str, Any]:
        for old, new in _DEPRECATED.items():
            if old not in data:
                continue
            if new in data:
                problem = Problem(
                    (old, new), f"{old} is the deprecated spelling of {new}; give {new}"
                )
                raise problems_error([problem])
            if data.pop(old):
                data[new] = {"device": "cpu"}
        return data

    def _check(self, context: Mapping[str, Any]) -> list[Problem]:
        if self.overlap_comm is None:
            self._set_derived("overlap_comm", self.stage == 3)
        return []

    def _advise(self) -> list[Problem]:
        # DeepSpeed loads these and ignores them; zerolap says so rather than failing a config
        # that runs on DeepSpeed.
        notes = []
        ignored = f"ignored at stage {self.stage}"
        if self.offload_param is not None and self.offload_param.enabled and self.stage != 3:
            notes.append(Problem(("offload_param",), f"{ignored}: parameter offload needs stage 3"))
        offload = self.offload_optimizer
        if offload is not None and offload.enabled and self.stage == 0:
            message = f"{ignored}: optimizer offload needs stage 1, 2 or 3"
            notes.append(Problem(("offload_optimizer",), message))
        return notes
