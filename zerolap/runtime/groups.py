"""DeepSpeed's module-level group questions (``deepspeed.utils.groups``), answered from the
job's mesh (``zerolap.topology``): sequence parallelism's when it is set up (it stays the
answer when an engine without it is made later, such as a reference model's, as DeepSpeed's
stays), else the last engine's. Accelerate and the Trainer ask for the sequence-parallel group
this way.

Expert groups are only looked up here, never made (making one is collective, and these are
asked by one rank at a time): they exist once an engine holds MoE layers of that size.
"""

from __future__ import annotations

import zerolap.comm as dist
from zerolap.sequence_parallel import state
from zerolap.topology import Mesh, job_mesh

__all__ = [
    "_get_data_parallel_group",
    "_get_data_parallel_rank",
    "_get_data_parallel_world_size",
    "_get_expert_data_parallel_group",
    "_get_expert_data_parallel_rank",
    "_get_expert_data_parallel_world_size",
    "_get_expert_parallel_group",
    "_get_expert_parallel_group_dict",
    "_get_expert_parallel_rank",
    "_get_expert_parallel_world_size",
    "_get_model_parallel_rank",
    "_get_model_parallel_world_size",
    "_get_sequence_data_parallel_group",
    "_get_sequence_data_parallel_rank",
    "_get_sequence_data_parallel_world_size",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
]


def _mesh() -> Mesh:
    return state.current_mesh() if state.initialized() else job_mesh()


def _get_sequence_parallel_group():
    if not state.initialized():
        raise KeyError(
            "No sequence parallel group found: sequence parallelism is not set up "
            "(UlyssesSPAttentionHF.register_with_transformers or initialize_sequence_parallel)"
        )
    return state.get_sequence_parallel_group()


def _get_sequence_parallel_world_size() -> int:
    return _mesh().get_sequence_parallel_world_size()


def _get_sequence_parallel_rank() -> int:
    return _mesh().get_sequence_parallel_rank()


def _get_sequence_data_parallel_group():
    return _mesh().get_sequence_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    return _mesh().get_sequence_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    return _mesh().get_sequence_data_parallel_rank()


def _get_data_parallel_group():
    return _mesh().get_data_parallel_group()


def _get_data_parallel_world_size() -> int:
    return _mesh().get_data_parallel_world_size()


def _get_data_parallel_rank() -> int:
    return _mesh().get_data_parallel_rank()


def _get_model_parallel_world_size() -> int:
    return _mesh().get_model_parallel_world_size()


def _get_model_parallel_rank() -> int:
    return _mesh().get_model_parallel_rank()


def _experts(group_name: str):
    mesh = _mesh()
    made = {f"ep_size_{size}": groups for size, groups in mesh.experts.items()}
    if group_name not in made:
        raise KeyError(
            f"no expert-parallel group {group_name!r}: the engine makes one for each MoE "
            f"ep_size it holds ({sorted(made) or 'none yet'})"
        )
    return made[group_name]


def _get_expert_parallel_group(group_name: str):
    return _experts(group_name).expert_group


def _get_expert_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(_get_expert_parallel_group(group_name))


def _get_expert_parallel_rank(group_name: str) -> int:
    return _experts(group_name).expert_rank


def _get_expert_data_parallel_group(group_name: str):
    return _experts(group_name).data_group


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(_get_expert_data_parallel_group(group_name))


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return dist.get_rank(_get_expert_data_parallel_group(group_name))


def _get_expert_parallel_group_dict() -> dict:
    return {f"ep_size_{size}": g.expert_group for size, g in _mesh().experts.items()}
