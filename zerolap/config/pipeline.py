"""``pipeline``: DeepSpeed's pipeline section, read where a ``PipelineModule`` is trained.

DeepSpeed's engine reads only ``pipe_partitioned`` and ``grad_partitioned`` (activations and
their gradients split across the tensor group on their way between stages); its other keys
describe the ``PipelineModule`` that Megatron-DeepSpeed builds from them. zerolap checks those
against the module given to ``initialize``: a value set here that the module contradicts is an
error naming both, never a silent difference.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from zerolap.config.section import ConfigSection

__all__ = ["PipelineConfig"]


class PipelineConfig(ConfigSection):
    stages: int | Literal["auto"] = "auto"
    """Pipeline stages; ``auto`` takes the ``PipelineModule``'s ``num_stages``, a number must
    equal it."""
    partition: str = "best"
    """How layers are split; ``best`` takes the module's ``partition_method``, anything else
    (``parameters``, ``uniform``, ``type:<regex>``) must equal it."""
    seed_layers: bool | None = None
    """When set, must equal the module's ``seed_layers``."""
    activation_checkpoint_interval: int | None = Field(None, ge=0)
    """Above 0, set on the module (as DeepSpeed's pipeline engine does): runs of that many
    layers are recomputed in backward. 0 or null keeps the module's own."""
    use_reentrant: bool | None = None
    """``false``: the module's checkpointed runs use
    ``zerolap.checkpointing.non_reentrant_checkpoint`` (DeepSpeed's switch to torch's
    non-reentrant mode); ``true`` or null keep the module's ``activation_checkpoint_func``."""
    pipe_partitioned: bool = True
    """DeepSpeed splits activations across the tensor group between stages and all-gathers them
    on arrival. Either value trains identically. At tensor size 1 there is nothing to split (as
    in DeepSpeed); above it zerolap sends each tensor rank's whole copy and says so at start."""
    grad_partitioned: bool = True
    """The same for the gradients going back."""
    schedule: Literal["1f1b", "zb-h1"] = "1f1b"
    """zerolap's key: ``1f1b`` (interleaved when the module has ``virtual_stages``) or ``zb-h1``
    (zero bubble: each linear layer's weight gradients deferred into the cool-down;
    ``pipe.schedule``, ``pipe.weight_grad``)."""
