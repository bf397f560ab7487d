"""``ZerolapConfig``, the whole ds_config, and ``load_config``, which builds it before training.

Each component receives its own section (``cfg.zero_optimization``, ``cfg.fp16``, ...). The
batch-size triangle is resolved when the data-parallel world size is known, which
``load_config`` passes in as validation context; after ``load_config`` all three batch values are
set.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import AliasChoices, BeforeValidator, ConfigDict, Field, ValidationError

from zerolap.config.activation_checkpointing import ActivationCheckpointingConfig
from zerolap.config.batch import resolve_batch_size
from zerolap.config.checkpoint import CheckpointConfig
from zerolap.config.comms_logger import CommsLoggerConfig
from zerolap.config.deepspeed_keys import DeepSpeedKeys
from zerolap.config.errors import ConfigError, Problem, format_validation_error
from zerolap.config.flops_profiler import FlopsProfilerConfig
from zerolap.config.monitor import (
    CometConfig,
    CSVConfig,
    DeepSpeedMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)
from zerolap.config.nonfinite import NonFiniteConfig
from zerolap.config.optimizer import OptimizerConfig
from zerolap.config.pipeline import PipelineConfig
from zerolap.config.precision import (
    BF16Config,
    DataTypesConfig,
    DTypeName,
    FP16Config,
    TorchAutocastConfig,
    torch_dtype,
)
from zerolap.config.scheduler import SchedulerConfig
from zerolap.config.tensor_parallel import TensorParallelConfig
from zerolap.config.timers import TimersConfig
from zerolap.config.zero import ZeroConfig

__all__ = ["ZerolapConfig", "load_config", "parse_config", "read_config"]

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class ZerolapConfig(DeepSpeedKeys):
    """A ds_config: DeepSpeed's keys, spellings and defaults, checked at load."""

    auto_means_default = False  # DeepSpeed reads top-level values as they are
    # DeepSpeed ignores top-level keys it does not know, and real configs carry some (keys of
    # other tools, newer releases): they load, and the engine names each in one warning.
    unknown_key_is_error = False
    model_config = ConfigDict(**{**DeepSpeedKeys.model_config, "extra": "allow"})

    train_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step over all ranks (micro-batch × accumulation × world size)."""
    train_micro_batch_size_per_gpu: int | None = Field(None, ge=1)
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: int | None = Field(None, ge=1)
    """Micro-batches whose gradients are accumulated before each optimizer step."""
    data_parallel_size: int | None = Field(None, ge=1)
    """The number of data-parallel copies the job is meant to have (DeepSpeed's AutoTP
    examples write it; DeepSpeed reads it only beside ``sequence_parallel_size``). Checked
    against the launched job's: world size / (tensor × pipeline); another value is an error."""
    gradient_clipping: float = Field(1.0, ge=0, allow_inf_nan=False)
    """Clip the global gradient norm to this value; 0 turns clipping off. 1.0 by default, as in
    DeepSpeed 0.19.8 (older releases defaulted to 0)."""
    steps_per_print: float | None = None
    """Log progress (step, skipped steps, learning rates) and the wall-clock breakdown every
    this many optimizer steps; never by default, as in DeepSpeed 0.19.8. Any number is
    accepted, as DeepSpeed accepts it: a fraction rounds down, and null, infinity (Accelerate
    writes it), zero or a negative number never log (see ``print_interval``)."""
    vocabulary_size: int | None = Field(None, ge=1)
    """The model's vocabulary size, when the config states it: one not a multiple of 8 is
    warned about (matrix units work on multiples of 8; pad the vocabulary), as DeepSpeed
    does."""
    zero_allow_untested_optimizer: bool = False
    """DeepSpeed refuses a client optimizer under ZeRO unless this is true. zerolap shards any
    ``torch.optim.Optimizer``, so it behaves as DeepSpeed does with true, whatever the value."""
    zero_force_ds_cpu_optimizer: bool = True
    """DeepSpeed refuses any optimizer but its CPU Adam with optimizer offload unless this is
    false. zerolap steps any optimizer on the host, so it behaves as DeepSpeed does with false,
    whatever the value."""
    memory_breakdown: bool = False
    """Rank 0 logs its memory (``runtime.utils.see_memory_usage``) once the engine is built,
    and before and after every forward, backward and ``step()``."""
    dump_state: bool = False
    """Rank 0 logs the resolved ds_config (every key, defaults filled in) and the engine's
    layout once ``initialize`` has built it."""
    log_level: Annotated[
        Literal["debug", "info", "warning", "error", "critical"] | None,
        BeforeValidator(lambda v: v.lower() if isinstance(v, str) else v),
    ] = None
    """The level of zerolap's logger (``deepspeed.utils.logger`` under the shim) and its
    handlers, set by ``initialize``; unset leaves it as it is."""
    disable_python_gc: bool = False
    """Python's automatic cyclic GC stays off while the engine lives (``runtime.python_gc``);
    ``engine.collect_python_gc()`` collects where the loop chooses."""
    dataloader_drop_last: bool = False
    """The loader ``initialize(training_data=...)`` and ``engine.deepspeed_io`` build drops a
    last batch shorter than the micro-batch."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step, and print the breakdown."""
    prescale_gradients: bool = False
    """Divide gradients by the world size before reducing them rather than after."""
    gradient_predivide_factor: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Divide gradients by this before the reduction and by ``world_size / factor`` after."""
    communication_data_type: DTypeName = None
    """Dtype gradients are reduced in; null reduces them in the training dtype."""
    seq_parallel_communication_data_type: DTypeName = "fp32"
    """Under sequence parallelism (S > 1), the dtype gradients are reduced in, in place of
    ``communication_data_type`` (DeepSpeed's rule); null falls back to that."""
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    """What the comms logger records and prints."""
    optimizer: OptimizerConfig | None = None
    """The optimizer to build; null when the caller passes its own."""
    scheduler: SchedulerConfig | None = None
    """The learning-rate schedule to build; null when there is none or the caller passes one."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    """fp16 mixed precision and loss scaling."""
    bf16: BF16Config = Field(
        default_factory=BF16Config, validation_alias=AliasChoices("bf16", "bfloat16")
    )
    """bf16 mixed precision (also spelt ``bfloat16``)."""
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    """The dtypes of buffers and of gradient accumulation."""
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    """``torch.autocast`` around the engine's forward (bf16)."""
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """The ZeRO stage and its knobs."""
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    """How ``zerolap.checkpointing`` (``deepspeed.checkpointing``) keeps checkpoint inputs."""
    timers: TimersConfig = Field(default_factory=TimersConfig)
    """The throughput timer (``engine.tput_timer``)."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """How ``save_checkpoint`` checks that the ranks agree on the tag."""
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    """Profile the model's parameters, MACs and latencies once (``zerolap.profiling.flops``)."""
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """Training events as TensorBoard scalars (``zerolap.monitor``)."""
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    """Training events as CSV files (``zerolap.monitor``)."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Training events logged to Weights & Biases (``zerolap.monitor``)."""
    comet: CometConfig = Field(default_factory=CometConfig)
    """Training events logged to Comet (``zerolap.monitor``)."""
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """Tensor parallelism (DeepSpeed's AutoTP training)."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """Pipeline parallelism (a ``zerolap.pipe.PipelineModule`` trained with ``train_batch``)."""
    nonfinite_gradients: NonFiniteConfig = Field(default_factory=NonFiniteConfig)
    """What a step with inf or nan gradients does (outside fp16's dynamic loss scaling)."""

    @property
    def print_interval(self) -> int | None:
        """``steps_per_print`` as a whole number of steps, or None for never."""
        value = self.steps_per_print
        if value is None or not math.isfinite(value) or value < 1:
            return None
        return int(value)

    @property
    def monitor_config(self) -> DeepSpeedMonitorConfig:
        """The four monitor blocks together, as DeepSpeed's config object offers them."""
        blocks = DeepSpeedMonitorConfig.model_fields
        return DeepSpeedMonitorConfig(**{name: getattr(self, name) for name in blocks})

    @property
    def fp16_enabled(self) -> bool:
        return self.fp16.enabled

    @property
    def bfloat16_enabled(self) -> bool:
        return self.bf16.enabled

    @property
    def precision(self) -> Literal["fp32", "fp16", "bf16"]:
        """The training dtype of parameters and gradients."""
        if self.fp16.enabled:
            return "fp16"
        return "bf16" if self.bf16.enabled else "fp32"

    @property
    def communication_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in; None means the training dtype."""
        return torch_dtype(self.communication_data_type)

    def reduction_dtype(self, sequence_parallel: bool) -> torch.dtype | None:
        """``communication_dtype``, or under sequence parallelism its own key's when set."""
        own = torch_dtype(self.seq_parallel_communication_data_type)
        return own if sequence_parallel and own is not None else self.communication_dtype

    @classmethod
    def _rewrite_legacy(cls, data: dict[str, Any]) -> dict[str, Any]:
        # DeepSpeed's oldest form: "zero_optimization": true means stage 1.
        zero = data.get("zero_optimization")
        if isinstance(zero, bool):
            data["zero_optimization"] = {"stage": int(zero)}
            if zero and "allgather_size" in data:
                data["zero_optimization"]["allgather_bucket_size"] = data.pop("allgather_size")
        return data

    def _advise(self) -> list[Problem]:
        if self.vocabulary_size and self.vocabulary_size % 8:
            message = (
                f"{self.vocabulary_size} is not a multiple of 8; matrix units (tensor cores) "
                "work on multiples of 8, so padding the vocabulary speeds the embedding and head"
            )
            return [Problem(("vocabulary_size",), message)]
        return []

    def _check(self, context: Mapping[str, Any]) -> list[Problem]:
        problems = []
        if self.fp16.enabled and self.bf16.enabled:
            message = "fp16 and bf16 cannot both be enabled; choose one"
            problems.append(Problem(("fp16.enabled", "bf16.enabled"), message))
        elif self.data_types.param_dtype not in (None, self.precision):
            message = (
                f"{self.data_types.param_dtype!r}, but the parameters train in "
                f"{self.precision!r} (set by the fp16 and bf16 sections)"
            )
            problems.append(Problem(("data_types.param_dtype",), message))
        if not self.zero_optimization.compute_grad_norm and self.gradient_clipping > 0:
            message = "clipping needs the gradient norm; set gradient_clipping to 0 or this true"
            problems.append(
                Problem(("zero_optimization.compute_grad_norm", "gradient_clipping"), message)
            )
        problems += self._check_bf16_master()
        if self.torch_autocast.enabled and self.fp16.enabled:
            message = "autocast to bf16 over fp16 parameters; use one of the two"
            problems.append(Problem(("torch_autocast.enabled", "fp16.enabled"), message))
        tp = self.tensor_parallel
        if self.torch_autocast.enabled and tp.size > 1:
            # Their matrix products are autograd Functions of their own, which autocast does
            # not cast: bf16 gradients would meet fp32 weights in their backward.
            message = "tensor-parallel layers do not run under autocast; use bf16 instead"
            problems.append(
                Problem(("torch_autocast.enabled", "tensor_parallel.autotp_size"), message)
            )
        if tp.size > 1 and tp.overlap_mode == "full" and self.zero_optimization.stage == 3:
            # Stage 3 gathers and releases a module's parameters around each call; the two
            # lanes call every module of a block twice, interleaved, inside one gathering.
            message = "full overlap splits blocks into lanes, which stage 3 does not support; "
            message += "use overlap: backward with stage 3, or stages 0-2"
            problems.append(
                Problem(("tensor_parallel.overlap", "zero_optimization.stage"), message)
            )
        world_size = context.get("world_size")
        wanted = self.data_parallel_size
        # Beside sequence parallelism (refused on its own) the two would be counted together.
        sequence = self.sequence_parallel_size in (None, 1)
        if world_size is not None and wanted is not None and wanted != world_size and sequence:
            message = (
                f"{wanted} data-parallel copies asked, but the job has {world_size} (its world "
                "size over the tensor- and pipeline-parallel sizes)"
            )
            problems.append(Problem(("data_parallel_size",), message))
        if world_size is not None:
            try:
                batch = self._batch(world_size)
            except ValueError as error:
                problems.append(Problem(_BATCH_KEYS, str(error)))
            else:
                for name, value in batch._asdict().items():
                    self._set_derived(name, value)
        return problems

    def _check_bf16_master(self) -> list[Problem]:
        """``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``: together, with bf16,
        at ZeRO stages 1-3 (as DeepSpeed requires), without offload."""
        bf16, zero = self.bf16, self.zero_optimization
        master, states = bf16.bf16_master_weights_and_grads, bf16.bf16_optimizer_states
        keys = ("bf16.bf16_master_weights_and_grads", "bf16.bf16_optimizer_states")
        if not (master or states):
            return []
        if master != states:
            message = "zerolap's optimizer keeps its state in the parameters' dtype: set both "
            message += (
                "(DeepSpeed keeps fp32 state for bf16 masters only in its offloaded CPU Adam)"
            )
            return [Problem(keys, message)]
        if not bf16.enabled:
            return [Problem((keys[0], "bf16.enabled"), "bf16 master weights need bf16 training")]
        if zero.stage == 0:
            message = "bf16 master weights are a ZeRO optimizer's: use stage 1, 2 or 3"
            return [Problem((keys[0], "zero_optimization.stage"), message)]
        # offload_param means something at stage 3 only (at stages 1-2 the advice says so).
        names = (
            ("offload_optimizer", "offload_param") if zero.stage == 3 else ("offload_optimizer",)
        )
        offloads = [
            f"zero_optimization.{name}"
            for name in names
            if getattr(zero, name) is not None and getattr(zero, name).enabled
        ]
        if offloads:
            message = "zerolap steps bf16 masters only where training runs, not offloaded"
            return [Problem((keys[0], *offloads), message)]
        return []

    def _batch(self, world_size: int):
        """The batch triangle over ``world_size`` data-parallel ranks. Under tensor
        parallelism DeepSpeed (and the Trainer, which fills the value in) counts every rank in
        ``train_batch_size``, although the T ranks of a tensor group share their batch: that
        value is accepted too, and resolved to the samples a step really takes."""
        given = dict(
            train_batch_size=self.train_batch_size,
            train_micro_batch_size_per_gpu=self.train_micro_batch_size_per_gpu,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
        )
        try:
            return resolve_batch_size(**given, world_size=world_size)
        except ValueError:
            tensor = self.tensor_parallel.size
            if tensor == 1 or self.train_batch_size is None:
                raise
            counted = resolve_batch_size(**given, world_size=world_size * tensor)
            return counted._replace(train_batch_size=counted.train_batch_size // tensor)


def read_config(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """The ds_config as a dict, unvalidated: a JSON file read, or the caller's own dict (as
    DeepSpeed keeps it: ``engine.config`` is the object the client passed)."""
    source = "ds_config"
    if isinstance(config, (str, os.PathLike)):
        source = f"ds_config {os.fspath(config)}"
        config = _read_json(Path(config))
    if not isinstance(config, Mapping):
        raise ConfigError(f"{source} must be a JSON object; got {type(config).__name__}")
    return config if isinstance(config, dict) else dict(config)


def load_config(config: Mapping[str, Any] | str | os.PathLike, *, world_size: int) -> ZerolapConfig:
    """Parse and check a ds_config (a dict or the path of a JSON file) for ``world_size``
    data-parallel ranks. Raises ``ConfigError`` listing every problem, each by its dotted key."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int; got {world_size!r}")
    return _validate(config, {"world_size": world_size})


def parse_config(config: Mapping[str, Any] | str | os.PathLike) -> ZerolapConfig:
    """Parse and check a ds_config as ``load_config`` does, but with no world size: the batch
    sizes stay as given, unresolved. For components configured apart from ``initialize``, such
    as ``zerolap.checkpointing.configure``."""
    return _validate(config, {})


def _validate(config: Mapping[str, Any] | str | os.PathLike, context: dict) -> ZerolapConfig:
    source = "ds_config"
    if isinstance(config, (str, os.PathLike)):
        source = f"ds_config {os.fspath(config)}"
    config = read_config(config)
    try:
        return ZerolapConfig.model_validate(config, context=context)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source=source)) from None


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read ds_config {path}: {error.strerror}") from None
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"ds_config {path} is not valid JSON: {error.msg} at line {error.lineno}, "
            f"column {error.colno}"
        ) from None
    except ValueError as error:
        raise ConfigError(f"ds_config {path}: {error}") from None


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        raise ValueError(f"duplicate keys {', '.join(duplicates)} (DeepSpeed rejects them too)")
    return dict(pairs)
