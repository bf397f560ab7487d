"""``zerolap.checkpointing``: DeepSpeed's activation checkpointing (``deepspeed.checkpointing``).

``checkpoint(function, *args)`` returns what ``function(*args)`` returns but keeps none of its
activations: backward runs ``function`` again to recompute them. Megatron-style code also takes
the model-parallel RNG tracker from here (``get_cuda_rng_tracker``,
``model_parallel_cuda_manual_seed``).

How a checkpointed call runs (torch.utils.checkpoint does the autograd work):

forward     torch runs ``function`` without keeping activations and stashes the CPU and CUDA
            generator states; ``_Replay`` stashes the RNG tracker's states. The inputs torch
            saves for the recompute pass through an ``InputStore`` when the configuration
            asks for one: this rank's shard only (``partition_activations`` over T > 1
            model-parallel ranks), moved to CPU memory (``cpu_checkpointing``), copied into a
            preallocated slot (``contiguous_memory_optimization``); see ``saved_inputs``.
recompute   in backward, torch restores the generators, ``_Replay`` restores the tracker, the
            store gives each input back whole on its device (all-gathering the shards over the
            model-parallel group), and ``function`` runs again with grad, drawing the same dropout
            masks, so gradients equal those of the uncheckpointed call exactly.

``checkpoint`` is reentrant, as DeepSpeed's is: parameters inside ``function`` get gradients only
if some tensor input requires grad. ``non_reentrant_checkpoint`` lifts that restriction.

Unlike DeepSpeed, the caller's input tensors are never emptied in place: the store keeps its own
copy (shard, CPU copy or slot), and the input's memory is freed when nothing else refers to it,
as between checkpointed layers.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from pydantic import ValidationError

import zerolap.comm as dist
from zerolap.checkpointing.rng import (
    MODEL_PARALLEL_RNG,
    TRACKER,
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
    manual_seed,
)
from zerolap.checkpointing.saved_inputs import InputStore, ModelParallel, model_parallel_of
from zerolap.config import ActivationCheckpointingConfig, ConfigError, ZerolapConfig, parse_config
from zerolap.config.activation_checkpointing import IN_FORCE
from zerolap.config.errors import format_validation_error
from zerolap.utils.logging import log_dist

__all__ = [
    "MODEL_PARALLEL_RNG",
    "CheckpointFunction",
    "CudaRNGStatesTracker",
    "checkpoint",
    "configure",
    "configure_from_config",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
]

_SEED_OFFSET = 2718  # Megatron's and DeepSpeed's: model-parallel seed = seed + 2718 + tp rank


# --- Configuration ------------------------------------------------------------------------------


class _Checkpointing:
    """What ``configure`` set, for the process (DeepSpeed keeps it in module globals)."""

    def __init__(self) -> None:
        self.config = ActivationCheckpointingConfig()  # the settings in force
        self.configured = False  # configure() was called: Megatron code reads this as opting in
        self.mpu: Any = None  # the model-parallel unit last given; kept until another is
        self.model_parallel = model_parallel_of(None)  # group, rank, size read from mpu
        self.store: InputStore | None = None  # None: inputs are saved as torch saves them


_STATE = _Checkpointing()

_KEYWORDS = {  # configure()'s keyword -> the ds_config key it overrides
    "partition_activations": "partition_activations",
    "contiguous_checkpointing": "contiguous_memory_optimization",
    "num_checkpoints": "number_checkpoints",
    "checkpoint_in_cpu": "cpu_checkpointing",
    "synchronize": "synchronize_checkpoint_boundary",
    "profile": "profile",
}


def _in_force(settings: Mapping[str, Any], source: str) -> ActivationCheckpointingConfig:
    """``settings`` validated with the rules that apply once they are in force."""
    try:
        return ActivationCheckpointingConfig.model_validate(settings, context=IN_FORCE)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source=source)) from None


def _section_of(deepspeed_config: Any) -> ActivationCheckpointingConfig:
    if deepspeed_config is None:
        return ActivationCheckpointingConfig()
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config
    if isinstance(deepspeed_config, (Mapping, str, os.PathLike)):
        deepspeed_config = parse_config(deepspeed_config)
    if not isinstance(deepspeed_config, ZerolapConfig):
        raise TypeError(
            "configure(deepspeed_config=...) takes a ds_config dict, a JSON path or a parsed "
            f"zerolap config; got {type(deepspeed_config).__name__}"
        )
    return deepspeed_config.activation_checkpointing


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set up activation checkpointing, as DeepSpeed's ``configure``: from the defaults, then the
    ``activation_checkpointing`` block of ``deepspeed_config`` (a ds_config dict, the path of a
    JSON file, or a config from ``zerolap.config.load_config``), then the keywords that are not
    None. ``mpu_`` (Megatron's model-parallel unit, or None to keep the previous one) gives the
    group ``partition_activations`` shards over. Raises ``ConfigError`` naming the keys of
    settings that cannot work together."""
    given = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    settings = _section_of(deepspeed_config).model_dump()
    settings.update({_KEYWORDS[name]: value for name, value in given.items() if value is not None})
    source = "activation_checkpointing (ds_config, then configure()'s keywords)"
    configure_from_config(_in_force(settings, source), mpu=mpu_)
    _STATE.configured = True


def configure_from_config(section: ActivationCheckpointingConfig, *, mpu: Any = None) -> None:
    """Put ``section`` (a ds_config's ``activation_checkpointing``) in force, with ``mpu`` if
    given. Unlike ``configure`` it does not make ``is_configured()`` true: that stays the
    caller's own opt-in, which Megatron-style code tests before using this module."""
    section = _in_force(section.model_dump(), "activation_checkpointing")
    if mpu is not None:
        _STATE.mpu = mpu
    model_parallel = model_parallel_of(_STATE.mpu)
    if (
        section.partition_activations
        and model_parallel.world_size > 1
        and not dist.is_initialized()
    ):
        raise RuntimeError(
            "partition_activations over a model-parallel group needs the process group: call "
            "zerolap.init_distributed() before zerolap.checkpointing.configure()"
        )
    _STATE.config = section
    _STATE.model_parallel = model_parallel
    _STATE.store = InputStore.for_config(section, model_parallel)
    _log_settings(section, model_parallel)


def _log_settings(section: ActivationCheckpointingConfig, model_parallel: ModelParallel) -> None:
    notes = []
    if section.partition_activations and model_parallel.world_size == 1:
        notes.append("partition_activations has no effect: the model-parallel world size is 1")
    if section.cpu_checkpointing and not torch.cuda.is_available():
        notes.append("cpu_checkpointing has no effect: without CUDA, inputs are on the CPU")
    if section.synchronize_checkpoint_boundary and not torch.cuda.is_available():
        notes.append("synchronize_checkpoint_boundary has no effect without CUDA")
    settings = ", ".join(f"{key}={value}" for key, value in section.model_dump().items())
    log_dist("; ".join([f"activation checkpointing: {settings}", *notes]), ranks=[0])


def is_configured() -> bool:
    """Whether ``configure`` has been called."""
    return _STATE.configured


def reset() -> None:
    """Drop the contiguous buffers, as after a backward: call it after forward passes that have
    no backward (evaluation with grad enabled), so their slots do not run out."""
    if _STATE.store is not None:
        _STATE.store.release()


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's setter for ``partition_activations`` alone."""
    settings = {**_STATE.config.model_dump(), "partition_activations": partition_activation}
    configure_from_config(ActivationCheckpointingConfig.model_validate(settings))


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's setter for ``number_checkpoints`` alone."""
    settings = {**_STATE.config.model_dump(), "number_checkpoints": nlayers}
    configure_from_config(ActivationCheckpointingConfig.model_validate(settings))


# --- Seeds ---------------------------------------------------------------------------------------


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the accelerator's generator with ``seed`` (the same on all model-parallel ranks: for
    dropout outside model-parallel regions) and reset the tracker to one state,
    ``model-parallel-rng``, seeded with ``seed + 2718 + tensor-model-parallel rank`` (for dropout
    inside them). The rank comes from the ``mpu`` given to ``configure``; 0 without one. On
    CPU-only runs the CPU generator is the accelerator's."""
    tp_rank = _STATE.model_parallel.rank
    model_parallel_seed = seed + _SEED_OFFSET + tp_rank
    log_dist(
        f"model-parallel seeds: default generator {seed}, {MODEL_PARALLEL_RNG} "
        f"{model_parallel_seed} (tensor-model-parallel rank {tp_rank})",
        ranks=[0],
    )
    TRACKER.reset()
    manual_seed(seed)
    TRACKER.add(MODEL_PARALLEL_RNG, model_parallel_seed)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Reseed the ``model-parallel-rng`` state as ``model_parallel_cuda_manual_seed(seed)``
    would, leaving the default generator alone."""
    with TRACKER.fork():
        manual_seed(seed + _SEED_OFFSET + _STATE.model_parallel.rank)


# --- Checkpointed calls -------------------------------------------------------------------------


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def _boundary(config: ActivationCheckpointingConfig, phase: str, function: Callable):
    """A checkpoint boundary: synchronise the device around ``phase`` and time it, as asked."""
    timed = config.profile
    if timed or config.synchronize_checkpoint_boundary:
        _synchronize()
    start = time.perf_counter()
    yield
    if timed or config.synchronize_checkpoint_boundary:
        _synchronize()
    if timed:
        name = getattr(function, "__qualname__", type(function).__name__)
        milliseconds = (time.perf_counter() - start) * 1e3
        log_dist(f"activation checkpoint {phase} of {name}: {milliseconds:.3f} ms", ranks=[0])


class _Replay:
    """``function`` as torch.utils.checkpoint calls it: the first call is the forward, each later
    one a recompute, run with the RNG tracker's states as they were at the forward (torch
    restores the CPU and CUDA generators itself)."""

    def __init__(self, function: Callable, config: ActivationCheckpointingConfig) -> None:
        self.function = function
        self.config = config
        self.tracker_states: dict[str, torch.Tensor] | None = None  # set by the forward

    def __call__(self, *args: Any) -> Any:
        if self.tracker_states is None:
            self.tracker_states = TRACKER.get_states()
            return self.function(*args)
        outside = TRACKER.get_states()
        TRACKER.set_states(dict(self.tracker_states))
        try:
            with _boundary(self.config, "recompute", self.function):
                return self.function(*args)
        finally:
            TRACKER.set_states(outside)


def _checkpointed(function: Callable, args: tuple, *, use_reentrant: bool) -> Any:
    config, store = _STATE.config, _STATE.store
    saving = store.saving() if store is not None else contextlib.nullcontext()
    with _boundary(config, "forward", function), saving:
        return torch_checkpoint.checkpoint(
            _Replay(function, config), *args, use_reentrant=use_reentrant
        )


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, with its activations recomputed in backward rather than
    kept. Arguments may be tensors (requiring grad or not) or anything else; tensors passed by
    keyword take part in autograd as positional ones do. Outputs may be a tensor or a tuple
    mixing tensors and other values. Reentrant, as DeepSpeed's: without a tensor input that
    requires grad, nothing inside ``function`` gets a gradient."""
    if not kwargs:
        return _checkpointed(function, args, use_reentrant=True)
    keys, positional = tuple(kwargs), len(args)

    def with_keywords(*flat: Any) -> Any:  # torch's reentrant checkpoint takes no keywords
        return function(*flat[:positional], **dict(zip(keys, flat[positional:], strict=True)))

    with_keywords.__qualname__ = getattr(function, "__qualname__", type(function).__name__)

    return _checkpointed(with_keywords, (*args, *kwargs.values()), use_reentrant=True)


def non_reentrant_checkpoint(function: Callable, *args: Any) -> Any:
    """``checkpoint`` built on torch's non-reentrant checkpoint: parameters inside ``function``
    get gradients even when no input requires grad."""
    return _checkpointed(function, args, use_reentrant=False)


class CheckpointFunction:
    """Call-compatible with DeepSpeed's ``CheckpointFunction.apply(run_function, all_outputs,
    *args)``: runs ``checkpoint``, appends every output to ``all_outputs`` and returns the tensor
    outputs. (Not itself a ``torch.autograd.Function``: torch.utils.checkpoint's is used.)"""

    @staticmethod
    def apply(run_function: Callable, all_outputs: list, *args: Any) -> Any:
        outputs = checkpoint(run_function, *args)
        if isinstance(outputs, torch.Tensor):
            all_outputs.append(outputs)
            return outputs
        all_outputs.extend(outputs)
        return tuple(output for output in outputs if isinstance(output, torch.Tensor))
