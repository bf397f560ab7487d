"""Top-level DeepSpeed keys that zerolap accepts but does not implement.

They are stored as given, so an existing ds_config loads unchanged, and ``unsupported_keys()``
names those set to something other than their default or "off" so the engine can print one
warning. Their contents are not checked: zerolap never reads them, so a misspelling inside one
changes nothing. A value that would change the results if ignored (Apex AMP, sparse gradients,
progressive layer drop, ...) is an error.

The list follows DeepSpeed 0.19's ``runtime/config.py`` and the sections it reads
(compression, data efficiency, checkpointing, ...), plus a few newer keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator

from zerolap.config.section import ConfigSection, DeepSpeedOnly, enabled, is_true

__all__ = ["DeepSpeedKeys"]

Block = dict[str, Any] | None
"""A DeepSpeed feature block, stored unread."""


def _any_enabled(value: Any) -> bool:
    """Whether any block nested in ``value`` is switched on (compression has many)."""
    if not isinstance(value, Mapping):
        return False
    return enabled(value) or any(_any_enabled(inner) for inner in value.values())


def _is_false(value: Any) -> bool:
    return value is False


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


_PRECISION = "it changes the numerics; use the fp16 or bf16 section"
_TRAINING = "it changes what is trained"


class DeepSpeedKeys(ConfigSection):
    """The DeepSpeed-only top-level keys (a base of ``ZerolapConfig``)."""

    # Features zerolap does not have; ignoring them leaves the training itself unchanged.
    aio: Annotated[Block, DeepSpeedOnly()] = None
    """DeepSpeed's libaio request shape for NVMe offload (``block_size``, ``queue_depth``,
    ``intra_op_parallelism``). zerolap issues each swap region as one direct request, which
    the kernel splits and queues itself: ``benchmarks/offload_bench.py --io-shapes`` on this
    project's VM disk moved 256 MiB at 948 MiB/s written and 2908 read as one request, against
    915-996 and 2351-3073 as 1 or 4 MiB blocks from 1 to 8 threads (at best 1.06x), so the
    block shape is not offered."""
    autotuning: Annotated[Block, DeepSpeedOnly()] = None
    """DeepSpeed's autotuner."""
    nebula: Annotated[Block, DeepSpeedOnly()] = None
    """DeepSpeed's Nebula asynchronous checkpointing."""
    datastates: Annotated[Block, DeepSpeedOnly()] = None
    """DeepSpeed's DataStates asynchronous checkpointing."""
    sparse_attention: Annotated[Block, DeepSpeedOnly()] = None
    """DeepSpeed's sparse attention kernels (used through its own modules)."""
    hybrid_engine: Annotated[Block, DeepSpeedOnly()] = None
    """DeepSpeed's hybrid training/inference engine for RLHF."""
    weight_quantization: Annotated[Block, DeepSpeedOnly()] = None
    """DeepSpeed's post-training weight quantisation."""
    compile: Annotated[Block, DeepSpeedOnly()] = None
    """DeepSpeed's torch.compile integration and DeepCompile."""
    expert_parallel: Annotated[Block, DeepSpeedOnly()] = None
    """DeepSpeed's automatic expert parallelism."""
    eigenvalue: Annotated[Block, DeepSpeedOnly()] = None
    """DeepSpeed's Hessian eigenvalue estimation (for MoQ)."""
    disable_allgather: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed's legacy switch from all-gather to broadcast."""
    graph_harvesting: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed captures short kernel sequences in CUDA graphs."""
    use_data_before_expert_parallelism: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed's expert/data-parallel group order."""
    seed: Annotated[int | None, DeepSpeedOnly()] = None
    """A seed some DeepSpeed configs carry; zerolap does not seed anything from it."""
    allgather_size: Annotated[int | None, DeepSpeedOnly()] = None
    """Legacy: the all-gather bucket size with ``zero_optimization: true``."""

    # Features that change the results: accepted only when off.
    amp: Annotated[Block, DeepSpeedOnly(enabled, f"Apex AMP: {_PRECISION}")] = None
    """Apex AMP mixed precision."""
    sparse_gradients: Annotated[
        bool, DeepSpeedOnly(is_true, "sparse gradients are reduced densely in zerolap")
    ] = False
    """DeepSpeed reduces the gradients of sparse embeddings as sparse tensors."""
    progressive_layer_drop: Annotated[Block, DeepSpeedOnly(enabled, _TRAINING)] = None
    """DeepSpeed's progressive layer dropping."""
    curriculum_learning: Annotated[Block, DeepSpeedOnly(enabled, _TRAINING)] = None
    """DeepSpeed's (legacy) curriculum learning."""
    data_efficiency: Annotated[Block, DeepSpeedOnly(enabled, _TRAINING)] = None
    """DeepSpeed's data sampling and routing."""
    compression_training: Annotated[Block, DeepSpeedOnly(_any_enabled, _TRAINING)] = None
    """DeepSpeed's quantisation-aware training, pruning and distillation."""
    quantize_training: Annotated[Block, DeepSpeedOnly(enabled, _TRAINING)] = None
    """DeepSpeed's MoQ quantised training."""
    elasticity: Annotated[
        Block, DeepSpeedOnly(enabled, "elastic training chooses the batch size")
    ] = None
    """DeepSpeed's elastic training."""
    sequence_parallel_size: Annotated[
        int | None,
        DeepSpeedOnly(
            lambda size: size not in (None, 1),
            "DeepSpeed builds a device mesh from it; zerolap's sequence parallelism comes from "
            "the mpu UlyssesSPAttentionHF.register_with_transformers returns (Accelerate's "
            "path), passed to initialize(mpu=...)",
        ),
    ] = None
    """DeepSpeed's Ulysses sequence-parallel degree for its own device mesh."""
    gradient_allreduce_op: Annotated[
        Literal["mean", "sum"],
        BeforeValidator(_lower),
        DeepSpeedOnly(lambda op: op == "sum", "zerolap averages gradients over ranks"),
    ] = "mean"
    """How DeepSpeed combines gradients over ranks."""
    managed_gradient_accumulation: Annotated[
        bool, DeepSpeedOnly(_is_false, "zerolap steps only at accumulation boundaries")
    ] = True
    """False: every ``step()`` updates the weights, whatever the accumulation steps."""
