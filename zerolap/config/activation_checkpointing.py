"""The ``activation_checkpointing`` section: how ``zerolap.checkpointing.checkpoint`` (DeepSpeed's
``deepspeed.checkpointing.checkpoint``) keeps the inputs it saves for the recompute.

The section only configures calls that go through ``zerolap.checkpointing``; models that use
``torch.utils.checkpoint`` directly are not affected. ``zerolap.checkpointing.configure`` reads it
from a ds_config (its keywords override it), as DeepSpeed's does.

The rule between keys (``contiguous_memory_optimization`` needs ``number_checkpoints``) is
checked when the settings are put in force (validation context ``IN_FORCE``), after
``configure``'s keywords are applied, where DeepSpeed asserts it too; a ds_config merely loaded
for ``initialize`` is not held to it. Megatron-style scripts pass ``num_checkpoints=`` to
``configure`` and leave it out of the ds_config, and DeepSpeed's own loader accepts that.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from zerolap.config.errors import Problem
from zerolap.config.section import ConfigSection

__all__ = ["IN_FORCE", "ActivationCheckpointingConfig"]

IN_FORCE = {"activation_checkpointing_in_force": True}
"""Validation context under which the rules between keys apply."""


class ActivationCheckpointingConfig(ConfigSection):
    """The ``activation_checkpointing`` section."""

    partition_activations: bool = False
    """Each model-parallel rank keeps only its 1/T share of every floating-point input saved by a
    checkpointed call (T: the model-parallel world size of the ``mpu`` given to ``configure``);
    the inputs are all-gathered again for the recompute. With no ``mpu``, or a model-parallel
    world size of 1, this is exactly a no-op: a group of one keeps the whole input."""
    cpu_checkpointing: bool = False
    """Saved checkpoint inputs (or their shards) are moved to CPU memory and brought back to
    their device for the recompute. Inputs already on the CPU stay as they are, so on a CPU-only
    run this is a no-op."""
    contiguous_memory_optimization: bool = False
    """Saved checkpoint inputs (or their shards) are copied into one preallocated buffer per input
    position, with a slot for each of ``number_checkpoints`` checkpointed calls, rather than
    into separate allocations. Requires ``number_checkpoints``; every checkpointed call must save
    inputs of the same sizes at each position. (DeepSpeed also requires
    ``partition_activations``; zerolap lays out whichever form is kept, shard or whole input.)"""
    number_checkpoints: int | None = Field(None, ge=1)
    """Checkpointed calls between two backward passes: the slots of each contiguous buffer."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronise the CUDA device before and after each checkpointed forward and each
    recompute. A no-op without CUDA."""
    profile: bool = False
    """Time each checkpointed forward and each recompute (synchronising CUDA around them) and log
    the times through the ``zerolap`` logger."""

    def _check(self, context: Mapping[str, Any]) -> list[Problem]:
        in_force = context.get("activation_checkpointing_in_force", False)
        if in_force and self.contiguous_memory_optimization and self.number_checkpoints is None:
            message = (
                "contiguous_memory_optimization needs number_checkpoints, the number of "
                "checkpointed calls between backward passes, to size its buffers (configure()'s "
                "num_checkpoints= sets it too)"
            )
            return [Problem(("contiguous_memory_optimization", "number_checkpoints"), message)]
        return []
