"""Which ranks form which groups: the one place every parallelism asks.

The job's ranks form a (pipe, data, tensor) mesh, pipeline stages outermost and tensor-parallel
ranks *consecutive* (DeepSpeed's and Megatron's order):

    global rank = (pipe_rank * D + data_rank) * T + tensor_rank

so a tensor-parallel group (which talks in every layer, forward and backward) is a run of
neighbouring ranks, usually one host; data-parallel groups (which talk once per bucket) stride
across them; a pipeline's stages (which pass activations point to point) are the farthest
apart. ZeRO shards and reduces over the data-parallel group only; tensor parallelism talks in
the tensor group; a pipeline stage talks to its neighbours in the *pipe* group. The ranks that
together hold one copy of the model (the *model* group: every stage's tensor group) are what a
global gradient norm sums over besides the data-parallel ranks.

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

__all__ = [
    "Mesh",
    "ParallelDims",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "build_mesh",
    "mesh_from_mpu",
]


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of parallelism of a job of ``world_size`` ranks."""

    world_size: int
    """Ranks in the job."""
    tensor: int = 1
    """Tensor-parallel degree T: ranks that split each layer's matrices."""
    pipe: int = 1
    """Pipeline-parallel degree P: stages that each hold a run of the model's layers."""

    def __post_init__(self) -> None:
        if self.tensor < 1:
            raise ValueError(f"tensor_parallel.autotp_size must be at least 1, got {self.tensor}")
        if self.pipe < 1:
            raise ValueError(f"the number of pipeline stages must be at least 1, got {self.pipe}")
        if self.world_size % (self.tensor * self.pipe):
            degrees = f"tensor_parallel.autotp_size={self.tensor}"
            if self.pipe > 1:
                degrees = f"{self.pipe} pipeline stages x {degrees}"
            raise ValueError(
                f"{degrees} does not divide the world size {self.world_size}: the job must be "
                "data-parallel copies of (stages x tensor-parallel) ranks each"
            )

    @property
    def data(self) -> int:
        """Data-parallel degree: copies of the model, each seeing its own batches."""
        return self.world_size // (self.tensor * self.pipe)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(pipe_rank, data_rank, tensor_rank)`` of global ``rank``."""
        pipe, rest = divmod(rank, self.data * self.tensor)
        return (pipe, *divmod(rest, self.tensor))

    def rank_of(self, pipe: int, data: int, tensor: int) -> int:
        """The global rank at these coordinates."""
        return (pipe * self.data + data) * self.tensor + tensor

    def tensor_ranks(self, data_rank: int, pipe_rank: int = 0) -> list[int]:
        """The global ranks of the tensor group at ``(pipe_rank, data_rank)``."""
        return [self.rank_of(pipe_rank, data_rank, t) for t in range(self.tensor)]

    def data_ranks(self, tensor_rank: int, pipe_rank: int = 0) -> list[int]:
        """The global ranks of the data-parallel group at ``(pipe_rank, tensor_rank)``."""
        return [self.rank_of(pipe_rank, d, tensor_rank) for d in range(self.data)]

    def pipe_ranks(self, data_rank: int, tensor_rank: int) -> list[int]:
        """The global ranks of one pipeline: stage 0, 1, ... at ``(data_rank, tensor_rank)``."""
        return [self.rank_of(p, data_rank, tensor_rank) for p in range(self.pipe)]

    def model_ranks(self, data_rank: int) -> list[int]:
        """The global ranks that together hold one copy of the model."""
        return [self.rank_of(p, data_rank, t) for p in range(self.pipe) for t in range(self.tensor)]

    # DeepSpeed's topology objects (``PipeDataParallelTopology``) answer these.
    def get_dim(self, axis: str) -> int:
        return {"pipe": self.pipe, "data": self.data, "model": self.tensor}[axis]


def PipeDataParallelTopology(num_pp: int, num_dp: int) -> ParallelDims:
    """DeepSpeed's topology of ``num_pp`` stages times ``num_dp`` data-parallel copies."""
    return ParallelDims(num_pp * num_dp, tensor=1, pipe=num_pp)


def PipeModelDataParallelTopology(num_pp: int, num_mp: int, num_dp: int) -> ParallelDims:
    """DeepSpeed's (Megatron-DeepSpeed's) 3D topology: stages x data copies x tensor ranks."""
    return ParallelDims(num_pp * num_mp * num_dp, tensor=num_mp, pipe=num_pp)


@dataclass
class Mesh:
    """This rank's coordinates and groups. A group of the whole job is ``None`` (torch's
    default group), so a job without model parallelism runs exactly the code it ran before."""

    dims: ParallelDims
    rank: int
    data_group: torch_dist.ProcessGroup | None
    # None when T == 1: nothing to talk about. Not a group of one (creating those is a
    # collective every job would pay for), so callers must test ``dims.tensor > 1`` first.
    tensor_group: torch_dist.ProcessGroup | None
    # This rank's pipeline (its stages, in order); None when P == 1.
    pipe_group: torch_dist.ProcessGroup | None = None
    # Every rank holding a piece of this rank's copy of the model: the tensor group without a
    # pipeline, every stage's tensor group with one; None when the model is not split.
    model_group: torch_dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.model_group is None and self.dims.pipe == 1:
            self.model_group = self.tensor_group

    @property
    def pipe_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.dims.coordinates(self.rank)[0]

    @property
    def data_rank(self) -> int:
        return self.dims.coordinates(self.rank)[1]

    @property
    def tensor_rank(self) -> int:
        return self.dims.coordinates(self.rank)[2]

    def stage_rank(self, stage: int) -> int:
        """The global rank of ``stage`` in this rank's pipeline."""
        return self.dims.rank_of(stage, self.data_rank, self.tensor_rank)

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

    # DeepSpeed's grid calls the tensor-parallel ranks the model-parallel ones, pipeline or not.
    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group
    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.dims.pipe

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pipe_rank

    def get_pipe_parallel_group(self):
        return self.pipe_group

    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_stage_id = get_pipeline_model_parallel_rank


def build_mesh(tensor: int = 1, pipe: int = 1) -> Mesh:
    """The mesh of the current job with tensor-parallel degree ``tensor`` and ``pipe`` pipeline
    stages. Every rank must call it (it creates process groups) with the same degrees."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims(world, tensor, pipe)
    if dims.tensor == 1 and dims.pipe == 1:
        return Mesh(dims, rank, data_group=None, tensor_group=None)
    coords = [dims.coordinates(r) for r in range(world)]

    # Every rank creates every group, in the same order: torch's new_group is collective.
    def groups(keys, ranks_of):
        chosen = None
        for key in keys:
            group = dist.new_group(ranks_of(*key))
            if chosen is None and rank in ranks_of(*key):
                chosen = group
        return chosen

    pairs = sorted({(p, d) for p, d, _ in coords})
    tensor_group = groups(pairs, lambda p, d: dims.tensor_ranks(d, p)) if tensor > 1 else None
    # Groups of one when there is no data parallelism: ZeRO still needs a group to work over.
    pt = sorted({(t, p) for p, _, t in coords})
    data_group = groups(pt, lambda t, p: dims.data_ranks(t, p))
    pipe_group = model_group = None
    if dims.pipe > 1:
        dt = sorted({(d, t) for _, d, t in coords})
        pipe_group = groups(dt, dims.pipe_ranks)
        model_group = pipe_group
        if dims.tensor > 1:
            model_group = groups([(d,) for d in range(dims.data)], dims.model_ranks)
    return Mesh(
        dims,
        rank,
        data_group=data_group,
        tensor_group=tensor_group,
        pipe_group=pipe_group,
        model_group=model_group,
    )


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
    expected = dims.data_ranks(dims.coordinates(rank)[2])
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
