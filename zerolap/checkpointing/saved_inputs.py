"""How a checkpointed call keeps the inputs it saves for the recompute.

torch.utils.checkpoint saves the call's tensor inputs with ``ctx.save_for_backward`` (reentrant)
or through a node of its own (non-reentrant), outside the hooks it uses for the activations, so
``saved_tensors_hooks`` active around the call see exactly those inputs: ``InputStore.saving()``
returns such hooks. Each floating-point input is kept as the configuration asks, in this order:

1. ``partition_activations`` with T > 1 model-parallel ranks: this rank's shard, ceil(numel / T)
   elements, the last shard padded with zeros (``own_shard``); the recompute all-gathers the
   shards over the mpu's group through ``zerolap.comm``.
2. ``cpu_checkpointing``: moved to CPU memory; the recompute moves it back to its device.
3. ``contiguous_memory_optimization``: copied into a slot of a preallocated buffer
   (``ContiguousSlots``).

The store holds its own copy (or, with none of the three applying, a detached alias), so the
caller's tensor is left alone and freed as soon as nothing else refers to it. What the recompute
gets back equals the input exactly.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

import torch
from torch.autograd.graph import saved_tensors_hooks

import zerolap.comm as dist
from zerolap.config import ActivationCheckpointingConfig

__all__ = [
    "ContiguousSlots",
    "InputStore",
    "Kept",
    "ModelParallel",
    "model_parallel_of",
    "own_shard",
]


class ModelParallel(NamedTuple):
    group: Any
    """The mpu's tensor-model-parallel process group; None without an mpu."""
    rank: int
    world_size: int


def model_parallel_of(mpu: Any) -> ModelParallel:
    """The tensor-model-parallel group, rank and size of Megatron's ``mpu``, read as DeepSpeed
    reads them (the newer ``get_tensor_model_parallel_*`` names first)."""
    if mpu is None:
        return ModelParallel(None, 0, 1)
    if hasattr(mpu, "get_tensor_model_parallel_rank"):  # Megatron's newer names
        return ModelParallel(
            mpu.get_tensor_model_parallel_group(),
            mpu.get_tensor_model_parallel_rank(),
            mpu.get_tensor_model_parallel_world_size(),
        )
    return ModelParallel(
        mpu.get_model_parallel_group(),
        mpu.get_model_parallel_rank(),
        mpu.get_model_parallel_world_size(),
    )


def is_activation(value: Any, world_size: int) -> bool:
    """Whether a saved input is one the store handles (DeepSpeed's rule): a floating-point tensor
    with at least one element per rank, not marked ``no_checkpointing``."""
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.numel() >= world_size
        and not getattr(value, "no_checkpointing", False)
    )


def own_shard(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """A copy of ``rank``'s chunk of ``flat``: ceil(numel / world_size) elements, the tail padded
    with zeros."""
    shard_numel = -(-flat.numel() // world_size)
    start = min(rank * shard_numel, flat.numel())
    end = min(start + shard_numel, flat.numel())
    shard = flat.new_zeros(shard_numel)
    shard[: end - start] = flat[start:end]
    return shard


class Kept(NamedTuple):
    """A checkpoint input as the store holds it until the recompute."""

    data: torch.Tensor
    """The input, or this rank's shard of it; on CPU or in a slot when so configured."""
    shape: torch.Size
    device: torch.device
    """Where the recompute needs the input."""
    sharded: bool


class ContiguousSlots:
    """``contiguous_memory_optimization``: for each input position, one buffer of ``slots``
    equal slots, one per checkpointed call, allocated at once. Backward's first recompute drops
    the buffers: each kept input is a view that holds its buffer until its own recompute, and the
    next forward takes fresh ones."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.buffers: list[torch.Tensor] = []  # per input position: slots × that input's numel
        self.taken = 0  # calls that took a slot in the current buffers

    def take(self) -> int:
        if self.taken == self.slots:
            raise RuntimeError(
                f"activation_checkpointing.number_checkpoints is {self.slots}, but more "
                "checkpointed calls ran before a backward; raise it, or call "
                "zerolap.checkpointing.reset() after forward passes that have no backward"
            )
        self.taken += 1
        return self.taken - 1

    def copy_in(self, data: torch.Tensor, *, slot: int, position: int) -> torch.Tensor:
        numel = data.numel()
        if position == len(self.buffers):
            self.buffers.append(data.new_empty(self.slots * numel))
        buffer = self.buffers[position]
        if buffer.numel() != self.slots * numel or buffer.dtype != data.dtype:
            raise ValueError(
                f"contiguous_memory_optimization: input {position} of this checkpointed call "
                f"keeps {numel} elements of {data.dtype}, earlier calls' kept "
                f"{buffer.numel() // self.slots} of {buffer.dtype}; every call must save inputs "
                "of the same sizes"
            )
        return buffer[slot * numel : (slot + 1) * numel].copy_(data.reshape(-1))

    def release(self) -> None:
        self.buffers = []
        self.taken = 0


class InputStore:
    """Keeps the inputs of checkpointed calls as the configuration asks: as shards, in CPU
    memory, in contiguous slots (in that order; each step is skipped when not asked for)."""

    def __init__(
        self, *, model_parallel: ModelParallel, shard: bool, to_cpu: bool, slots: int | None
    ):
        self.model_parallel = model_parallel
        self.shard = shard  # keep this rank's shard; the recompute all-gathers
        self.to_cpu = to_cpu  # keep it in CPU memory
        self.slots = ContiguousSlots(slots) if slots is not None else None  # keep it in a slot

    @classmethod
    def for_config(
        cls, config: ActivationCheckpointingConfig, model_parallel: ModelParallel
    ) -> InputStore | None:
        """The store ``config`` asks for; None when inputs are to be kept as torch keeps them
        (``partition_activations`` over one rank asks for nothing)."""
        shard = config.partition_activations and model_parallel.world_size > 1
        slots = config.number_checkpoints if config.contiguous_memory_optimization else None
        if not (shard or config.cpu_checkpointing or slots is not None):
            return None
        return cls(
            model_parallel=model_parallel, shard=shard, to_cpu=config.cpu_checkpointing, slots=slots
        )

    def saving(self) -> saved_tensors_hooks:
        """The hooks under which one checkpointed call saves its inputs. Nothing is saved under
        no_grad, so a slot is taken at the first input actually saved."""
        positions = itertools.count()
        slot: int | None = None

        def pack(value: Any) -> Any:
            nonlocal slot
            if not is_activation(value, self.model_parallel.world_size):
                return value
            if self.slots is not None and slot is None:
                slot = self.slots.take()
            return self.keep(value, slot=slot, position=next(positions))

        return saved_tensors_hooks(pack, self.restore)

    def keep(self, tensor: torch.Tensor, *, slot: int | None, position: int) -> Kept:
        data = tensor.detach()
        if self.shard:
            mp = self.model_parallel
            data = own_shard(data.reshape(-1), mp.rank, mp.world_size)
        if self.to_cpu:
            data = data.to("cpu")
        if self.slots is not None:
            data = self.slots.copy_in(data, slot=slot, position=position)
        return Kept(data, tensor.shape, tensor.device, self.shard)

    def restore(self, kept: Any) -> Any:
        if not isinstance(kept, Kept):
            return kept
        if self.slots is not None:
            self.slots.release()
        data = kept.data.to(kept.device)
        if kept.sharded:
            full = data.new_empty(data.numel() * self.model_parallel.world_size)
            dist.all_gather_into_tensor(full, data, group=self.model_parallel.group)
            data = full[: math.prod(kept.shape)]
        return data.reshape(kept.shape)

    def release(self) -> None:
        if self.slots is not None:
            self.slots.release()
