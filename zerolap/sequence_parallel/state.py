"""Sequence parallelism's groups, as DeepSpeed's ``parallel_state_sp`` module gives them: this
module is the ``mpu`` that ``UlyssesSPAttentionHF.register_with_transformers`` returns and
Accelerate passes to ``initialize``. It holds a mesh of the job (``zerolap.topology``) with
sequence-parallel degree S; the engine takes that mesh whole (``mesh_from_mpu``)."""

from __future__ import annotations

import zerolap.comm as dist
from zerolap.comm.groups import is_world, on_destroy, world_ref
from zerolap.topology import Mesh, build_mesh

__all__ = [
    "current_mesh",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "initialize_sequence_parallel",
    "initialized",
]

_mesh: Mesh | None = None
_world = None  # the default group the mesh's groups belong to, weakly (``world_ref``)


def _forget() -> None:
    global _mesh, _world
    _mesh = _world = None  # destroyed with the default group: not kept alive here


on_destroy(_forget)


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Make the groups of sequence-parallel degree ``sequence_parallel_size`` (every rank calls
    it: it creates process groups). Again with the same size it keeps them; with another it
    makes new ones, and attention registered with the old ones refuses to run (DeepSpeed
    asserts instead)."""
    global _mesh, _world
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_sequence_parallel: no process group yet; call "
            "deepspeed.init_distributed() first"
        )
    size = sequence_parallel_size
    if size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {size}")
    if initialized() and _mesh.dims.sequence == size:
        return
    _mesh, _world = build_mesh(sequence=size), world_ref()


def initialized() -> bool:
    """Whether the groups exist (and belong to the current process group: a job that tore
    its process group down and made another has none)."""
    return _mesh is not None and is_world(_world)


def current_mesh() -> Mesh:
    if not initialized():
        raise RuntimeError(
            "sequence parallelism is not initialized: call initialize_sequence_parallel(size) "
            "(UlyssesSPAttentionHF.register_with_transformers does) first"
        )
    return _mesh


def get_sequence_parallel_group():
    return current_mesh().get_sequence_parallel_group()


def get_sequence_parallel_world_size() -> int:
    return current_mesh().get_sequence_parallel_world_size()


def get_sequence_parallel_rank() -> int:
    return current_mesh().get_sequence_parallel_rank()


def get_sequence_data_parallel_group():
    return current_mesh().get_sequence_data_parallel_group()


def get_sequence_data_parallel_world_size() -> int:
    return current_mesh().get_sequence_data_parallel_world_size()


def get_sequence_data_parallel_rank() -> int:
    return current_mesh().get_sequence_data_parallel_rank()


# DeepSpeed's module answers the model-parallel questions with the sequence-parallel groups
# (its engine knows this mpu by ``initialize_sequence_parallel`` and does not ask them).
get_model_parallel_group = get_sequence_parallel_group
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_rank = get_sequence_parallel_rank
