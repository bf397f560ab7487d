"""Which ranks form which groups: the one place every parallelism asks.

The job's ranks form a (data, tensor) mesh with the tensor-parallel ranks *consecutive*:

    global rank = data_rank * T + tensor_rank

so a tensor-parallel group (which talks in every layer, forward and backward) is a run of
neighbouring ranks, usually one host, while data-parallel groups (which talk once per bucket)
stride across hosts. ZeRO shards and reduces over the data-parallel group only; tensor
parallelism talks in the tensor group; the ranks that together hold one copy of the model (the
*model* group: the tensor group, here) are what a global gradient norm sums over besides the
data-parallel ranks.

``ParallelDims`` is the pure arithmetic (checked once, naming every degree); ``Mesh`` is this
rank's place in it with the process groups, built by ``build_mesh`` (every rank creates every
group, in one order, as torch requires) or read from a Megatron-style ``mpu`` object
(``mesh_from_mpu``). A ``Mesh`` answers the ``mpu`` methods DeepSpeed's clients call
(``get_data_parallel_group``, ``get_tensor_model_parallel_rank``, ...), so it can be passed
wherever an ``mpu`` is expected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as torch_dist

import zerolap.comm as dist

__all__ = ["Mesh", "ParallelDims", "build_mesh", "mesh_from_mpu"]


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of parallelism of a job of ``world_size`` ranks."""

    world_size: int
    """Ranks in the job."""
    tensor: int = 1
    """Tensor-parallel degree T: ranks that split each layer's matrices."""

    def __post_init__(self) -> None:
        if self.tensor < 1:
            raise ValueError(f"tensor_parallel.autotp_size must be at least 1, got {self.tensor}")
        if self.world_size % self.tensor:
            raise ValueError(
                f"tensor_parallel.autotp_size={self.tensor} does not divide the world size "
                f"{self.world_size}: the job must be data-parallel copies of T ranks each"
            )

    @property
    def data(self) -> int:
        """Data-parallel degree: copies of the model, each seeing its own batches."""
        return self.world_size // self.tensor

    def coordinates(self, rank: int) -> tuple[int, int]:
        """``(data_rank, tensor_rank)`` of global ``rank``."""
        return divmod(rank, self.tensor)

    def tensor_ranks(self, data_rank: int) -> list[int]:
        """The global ranks of the tensor group at ``data_rank``."""
        return [data_rank * self.tensor + t for t in range(self.tensor)]

    def data_ranks(self, tensor_rank: int) -> list[int]:
        """The global ranks of the data-parallel group at ``tensor_rank``."""
        return [d * self.tensor + tensor_rank for d in range(self.data)]


@dataclass
class Mesh:
    """This rank's coordinates and groups. A group of the whole job is ``None`` (torch's
    default group), so a job without tensor parallelism runs exactly the code it ran before."""

    dims: ParallelDims
    rank: int
    data_group: torch_dist.ProcessGroup | None
    # None when T == 1: nothing to talk about. Not a group of one (creating those is a
    # collective every job would pay for), so callers must test ``dims.tensor > 1`` first.
    tensor_group: torch_dist.ProcessGroup | None

    @property
    def data_rank(self) -> int:
        return self.dims.coordinates(self.rank)[0]

    @property
    def tensor_rank(self) -> int:
        return self.dims.coordinates(self.rank)[1]

    # -- the Megatron mpu protocol (what DeepSpeed and its clients call) --------------------------

    def get_data_parallel_group(self):
        return self.data_group if self.data_group is not None else dist.get_world_group()

    def get_data_parallel_rank(self) -> int:
        return self.data_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dims.data

    def get_tensor_model_parallel_group(self):
        return self.tensor_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tensor_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.dims.tensor

    # Without pipeline parallelism the model-parallel ranks are the tensor-parallel ones.
    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0


def build_mesh(tensor: int = 1) -> Mesh:
    """The mesh of the current job with tensor-parallel degree ``tensor``. Every rank must call
    it (it creates process groups) with the same ``tensor``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims(world, tensor)
    if dims.tensor == 1:
        return Mesh(dims, rank, data_group=None, tensor_group=None)
    data_rank, tensor_rank = dims.coordinates(rank)
    tensor_group = data_group = None
    # Every rank creates every group, in the same order: torch's new_group is collective.
    for d in range(dims.data):
        group = dist.new_group(dims.tensor_ranks(d))
        if d == data_rank:
            tensor_group = group
    if dims.data == 1:
        return Mesh(dims, rank, data_group=_single(rank), tensor_group=tensor_group)
    for t in range(dims.tensor):
        group = dist.new_group(dims.data_ranks(t))
        if t == tensor_rank:
            data_group = group
    return Mesh(dims, rank, data_group=data_group, tensor_group=tensor_group)


def _single(rank: int) -> torch_dist.ProcessGroup:
    """A data-parallel group of one (pure tensor parallelism): every rank creates every such
    group, as ``new_group`` requires."""
    mine = None
    for r in range(dist.get_world_size()):
        group = dist.new_group([r])
        if r == rank:
            mine = group
    return mine


def mesh_from_mpu(mpu) -> Mesh:
    """The mesh a Megatron-style ``mpu`` describes (``initialize(mpu=...)``): its data-parallel
    group and its tensor- (or model-) parallel group. The layout must be ours (tensor ranks
    consecutive), which Megatron's is; anything else is named."""
    for name in ("get_data_parallel_group", "get_model_parallel_world_size"):
        if not callable(getattr(mpu, name, None)):
            raise TypeError(f"initialize(mpu=...): the mpu object has no method {name}()")
    if callable(getattr(mpu, "get_pipeline_model_parallel_world_size", None)):
        stages = mpu.get_pipeline_model_parallel_world_size()
        if stages != 1:
            raise NotImplementedError(
                f"initialize(mpu=...): the mpu has {stages} pipeline stages; zerolap's engine "
                "takes tensor and data parallelism from an mpu, not pipeline stages"
            )
    if callable(getattr(mpu, "get_tensor_model_parallel_group", None)):
        tensor_group = mpu.get_tensor_model_parallel_group()
    else:
        tensor_group = mpu.get_model_parallel_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    tensor = mpu.get_model_parallel_world_size()
    dims = ParallelDims(world, tensor)
    data_group = mpu.get_data_parallel_group()
    expected = dims.data_ranks(dims.coordinates(rank)[1])
    if dist.get_all_ranks_from_group(data_group) != expected:
        raise ValueError(
            f"initialize(mpu=...): rank {rank}'s data-parallel group is ranks "
            f"{dist.get_all_ranks_from_group(data_group)}, but zerolap lays tensor-parallel ranks "
            f"out consecutively and expects {expected}"
        )
    if tensor == 1:
        tensor_group = None
    if dims.data == world:
        data_group = None
    return Mesh(dims, rank, data_group=data_group, tensor_group=tensor_group)
