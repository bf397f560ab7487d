"""Which ranks form which groups: the one place every parallelism asks.

The job's ranks form a (pipe, data, sequence, tensor) mesh, pipeline stages outermost and
tensor-parallel ranks *consecutive* (DeepSpeed's and Megatron's order):

    global rank = ((pipe_rank * D + data_rank) * S + sequence_rank) * T + tensor_rank

so a tensor-parallel group (which talks in every layer, forward and backward) is a run of
neighbouring ranks, usually one host; data-parallel groups (which talk once per bucket) stride
across them; a pipeline's stages (which pass activations point to point) are the farthest
apart. ZeRO shards and reduces over the data-parallel group only; tensor parallelism talks in
the tensor group; a pipeline stage talks to its neighbours in the *pipe* group. The ranks that
together hold one copy of the model (the *model* group: every stage's tensor group) are what a
global gradient norm sums over besides the data-parallel ranks.

Sequence parallelism (Ulysses, ``zerolap.sequence_parallel``; S > 1 only without tensor or
pipeline parallelism) puts S consecutive ranks on the pieces of the same sequences: they hold
the whole model each and work on the same batches, so "data-parallel" (distinct batches,
D = world / S) strides across them, while ZeRO shards and reduces over all D x S ranks
(DeepSpeed's *sequence-data-parallel* group, ``Mesh.zero_group``).

``ParallelDims`` is the pure arithmetic (checked once, naming every degree); ``Mesh`` is this
rank's place in it with the process groups, built by ``build_mesh`` (every rank creates every
group, in one order, as torch requires) or read from a Megatron-style ``mpu`` object
(``mesh_from_mpu``). A ``Mesh`` answers the ``mpu`` methods DeepSpeed's clients call
(``get_data_parallel_group``, ``get_tensor_model_parallel_rank``, ...), so it can be passed
wherever an ``mpu`` is expected.

DeepSpeed's own objects for the same mesh are views of these: ``ProcessTopology`` (named axes,
the last varying fastest; ``PipeDataParallelTopology`` is (pipe, data),
``PipeModelDataParallelTopology`` (pipe, data, model), our order) and ``PipelineParallelGrid``
(a pipeline engine's ``grid``: this rank's coordinates and groups, where "model parallel" means
every rank of one copy of the model, stages and tensor ranks together).
"""

from __future__ import annotations

import itertools
import math
from collections import namedtuple
from dataclasses import dataclass, field

import torch.distributed as torch_dist

import zerolap.comm as dist
from zerolap.comm.groups import is_world, on_destroy, world_ref

__all__ = [
    "ExpertGroups",
    "Mesh",
    "ParallelDims",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "ProcessTopology",
    "build_mesh",
    "job_mesh",
    "mesh_from_mpu",
    "parallel_dims",
    "use_mesh",
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
    sequence: int = 1
    """Sequence-parallel degree S: ranks that each hold a piece of every sequence."""

    def __post_init__(self) -> None:
        if self.tensor < 1:
            raise ValueError(f"tensor_parallel.autotp_size must be at least 1, got {self.tensor}")
        if self.pipe < 1:
            raise ValueError(f"the number of pipeline stages must be at least 1, got {self.pipe}")
        if self.sequence < 1:
            raise ValueError(f"sequence_parallel_size must be at least 1, got {self.sequence}")
        if self.sequence > 1 and (self.tensor > 1 or self.pipe > 1):
            raise ValueError(
                f"sequence_parallel_size={self.sequence} with tensor_parallel.autotp_size="
                f"{self.tensor} and {self.pipe} pipeline stages: zerolap's sequence parallelism "
                "runs with data parallelism only"
            )
        if self.world_size % (self.sequence * self.tensor * self.pipe):
            if self.sequence > 1:
                raise ValueError(
                    f"sequence_parallel_size={self.sequence} does not divide the world size "
                    f"{self.world_size}"
                )
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
        return self.world_size // (self.sequence * self.tensor * self.pipe)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(pipe_rank, data_rank, tensor_rank)`` of global ``rank``."""
        pipe, rest = divmod(rank, self.data * self.sequence * self.tensor)
        data_sequence, tensor = divmod(rest, self.tensor)
        return pipe, data_sequence // self.sequence, tensor

    def sequence_rank(self, rank: int) -> int:
        """Which piece of each sequence global ``rank`` holds."""
        return rank // self.tensor % self.sequence

    def rank_of(self, pipe: int, data: int, tensor: int, *, sequence: int = 0) -> int:
        """The global rank at these coordinates."""
        return ((pipe * self.data + data) * self.sequence + sequence) * self.tensor + tensor

    def tensor_ranks(self, data_rank: int, pipe_rank: int = 0) -> list[int]:
        """The global ranks of the tensor group at ``(pipe_rank, data_rank)``."""
        return [self.rank_of(pipe_rank, data_rank, t) for t in range(self.tensor)]

    def data_ranks(self, tensor_rank: int, pipe_rank: int = 0, *, sequence_rank: int = 0) -> list:
        """The global ranks of the data-parallel group at ``(pipe_rank, tensor_rank,
        sequence_rank)``."""
        return [
            self.rank_of(pipe_rank, d, tensor_rank, sequence=sequence_rank)
            for d in range(self.data)
        ]

    def sequence_ranks(self, data_rank: int) -> list[int]:
        """The global ranks of the sequence-parallel group at ``data_rank``."""
        return [self.rank_of(0, data_rank, 0, sequence=s) for s in range(self.sequence)]

    def pipe_ranks(self, data_rank: int, tensor_rank: int) -> list[int]:
        """The global ranks of one pipeline: stage 0, 1, ... at ``(data_rank, tensor_rank)``."""
        return [self.rank_of(p, data_rank, tensor_rank) for p in range(self.pipe)]

    def expert_ranks(self, data_rank: int, ep_size: int, tensor_rank=0, pipe_rank=0) -> list[int]:
        """The global ranks of the expert-parallel group of ``ep_size`` holding ``data_rank``."""
        first = data_rank - data_rank % ep_size
        return [self.rank_of(pipe_rank, d, tensor_rank) for d in range(first, first + ep_size)]

    def expert_data_ranks(
        self, data_rank: int, ep_size: int, tensor_rank=0, pipe_rank=0
    ) -> list[int]:
        """The global ranks holding the same experts as ``data_rank`` (every ``ep_size``-th)."""
        first = data_rank % ep_size
        return [self.rank_of(pipe_rank, d, tensor_rank) for d in range(first, self.data, ep_size)]

    def model_ranks(self, data_rank: int) -> list[int]:
        """The global ranks that together hold one copy of the model."""
        return [self.rank_of(p, data_rank, t) for p in range(self.pipe) for t in range(self.tensor)]

    def topology(self) -> ProcessTopology:
        """DeepSpeed's topology object for these degrees."""
        if self.tensor > 1:
            return PipeModelDataParallelTopology(self.pipe, self.tensor, self.data)
        return PipeDataParallelTopology(self.pipe, self.data)


class ProcessTopology:
    """DeepSpeed's ``ProcessTopology``: ranks laid out over named ``axes`` of sizes ``dims``,
    the last axis varying fastest (rank = row-major index of the coordinates)."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(
                f"ProcessTopology: axes {axes} and dims {dims} must pair up, once each"
            )
        if any(d < 1 for d in dims):
            raise ValueError(f"ProcessTopology: every dim must be at least 1, got {dims}")
        self.axes, self.dims = list(axes), list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)

    def world_size(self) -> int:
        return math.prod(self.dims)

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_dim(self, axis: str) -> int:
        """The size of ``axis``; 0 for an axis the topology does not have (DeepSpeed's answer,
        which lets code written for 3D run on 2D topologies)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int):
        if not 0 <= rank < self.world_size():
            raise ValueError(f"rank {rank} is not in a topology of {self.world_size()} ranks")
        coords = []
        for dim in reversed(self.dims):
            rank, coord = divmod(rank, dim)
            coords.append(coord)
        return self.ProcessCoord(*reversed(coords))

    def get_rank(self, **coords: int) -> int:
        if sorted(coords) != sorted(self.axes):
            raise ValueError(
                f"get_rank() takes a coordinate on every axis of {self.axes}, got "
                f"{sorted(coords)}; filter_match() selects on some"
            )
        rank = 0
        for axis, dim in zip(self.axes, self.dims, strict=True):
            if not 0 <= coords[axis] < dim:
                raise ValueError(f"{axis}={coords[axis]} is outside 0..{dim - 1}")
            rank = rank * dim + coords[axis]
        return rank

    def get_rank_repr(
        self, rank: int, omit_axes=("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-"
    ) -> str:
        """``model_01``-style names of ``rank``'s coordinates on the axes not omitted (what
        DeepSpeed's checkpoint file names use)."""
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{axis}{inner_sep}{getattr(coord, axis):02d}"
            for axis in self.axes
            if axis not in omit_axes
        )

    def filter_match(self, **selection: int) -> list[int]:
        """The ranks whose coordinates equal ``selection`` on the axes it names."""
        return [
            rank
            for rank in range(self.world_size())
            if all(getattr(self.get_coord(rank), a) == v for a, v in selection.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks at coordinate ``idx`` on ``axis``."""
        return self.filter_match(**{axis: idx})

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """One list per combination of the other axes: the ranks along ``axis`` there (the
        groups that talk along it); none for an axis the topology does not have."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values, strict=True))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def __str__(self) -> str:
        return str({self.get_coord(r): r for r in range(self.world_size())})


class PipeDataParallelTopology(ProcessTopology):
    """``num_pp`` pipeline stages times ``num_dp`` data-parallel copies."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data"], [num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Megatron-DeepSpeed's 3D topology: stages x data copies x tensor ("model") ranks."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data", "model"], [num_pp, num_dp, num_mp])


def parallel_dims(topology: ParallelDims | ProcessTopology) -> ParallelDims:
    """``topology`` as our degrees; a DeepSpeed topology must lay ranks out as we do (axes a
    prefix-respecting subset of pipe, data, model in that order), which DeepSpeed's own are."""
    if isinstance(topology, ParallelDims):
        return topology
    axes = topology.get_axis_names()
    if [a for a in ("pipe", "data", "model") if a in axes] != axes:
        raise ValueError(
            f"a topology with axes {axes}: zerolap lays ranks out as (pipe, data, model), the "
            "last varying fastest, and takes topologies whose axes are those, in that order"
        )
    return ParallelDims(
        topology.world_size(),
        tensor=max(topology.get_dim("model"), 1),
        pipe=max(topology.get_dim("pipe"), 1),
    )


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's groups for expert parallelism of one size (``Mesh.expert_groups``)."""

    expert_group: torch_dist.ProcessGroup  # exchanges tokens; holds the experts between them
    expert_rank: int  # place in it: which of the experts this rank holds
    data_group: torch_dist.ProcessGroup  # the ranks holding the same experts


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

    # The ranks holding the other pieces of this rank's sequences; None when S == 1.
    sequence_group: torch_dist.ProcessGroup | None = None

    # Expert parallelism's groups, by expert-parallel size, made on first request.
    experts: dict[int, ExpertGroups] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model_group is None and self.dims.pipe == 1:
            self.model_group = self.tensor_group

    @property
    def zero_group(self) -> torch_dist.ProcessGroup | None:
        """The ranks ZeRO shards over and reduces gradients across: the data-parallel group,
        and with sequence parallelism every rank holding a piece of its sequences too (the
        whole job, since S > 1 comes without tensor or pipeline parallelism)."""
        return self.data_group if self.dims.sequence == 1 else None

    def expert_groups(self, size: int) -> ExpertGroups:
        """The expert-parallel and expert-data-parallel groups of ``size``, made on the first
        request. Every rank must make the same requests in the same order (torch's
        ``new_group`` is collective)."""
        if size in self.experts:
            return self.experts[size]
        dims = self.dims
        if size < 1 or dims.data % size:
            raise ValueError(
                f"MoE ep_size={size} does not divide the data-parallel size {dims.data}: each "
                "expert-parallel group is a run of ep_size data-parallel ranks"
            )
        mine = {}
        for p, t in sorted({(p, t) for p, _, t in map(dims.coordinates, range(dims.world_size))}):
            for d in range(0, dims.data, size):
                ranks = dims.expert_ranks(d, size, t, p)
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    mine["expert"] = group
            for d in range(size):
                ranks = dims.expert_data_ranks(d, size, t, p)
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    mine["data"] = group
        made = ExpertGroups(mine["expert"], self.data_rank % size, mine["data"])
        self.experts[size] = made
        return made

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

    def get_sequence_parallel_group(self):
        if self.sequence_group is None:
            raise ValueError("this job has no sequence-parallel group (sequence_parallel_size 1)")
        return self.sequence_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.dims.sequence

    def get_sequence_parallel_rank(self) -> int:
        return self.dims.sequence_rank(self.rank)

    def get_sequence_data_parallel_group(self):
        group = self.zero_group
        return group if group is not None else dist.get_world_group()

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.dims.data * self.dims.sequence

    def get_sequence_data_parallel_rank(self) -> int:
        return self.data_rank * self.dims.sequence + self.get_sequence_parallel_rank()

    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_stage_id = get_pipeline_model_parallel_rank


class PipelineParallelGrid:
    """DeepSpeed's grid: this rank's place in a pipeline job, and its groups (a pipeline
    engine's ``grid``). Built from a ``topology`` it creates the job's groups; ``mesh=`` views a
    mesh that has them. Either way every rank must build it: where a degree is 1 the mesh has no
    group (torch's ``None`` would mean the whole job), so the grid makes groups of one rank, as
    DeepSpeed's does, and a collective over them stays on this rank."""

    def __init__(self, topology=None, process_group=None, *, mesh: Mesh | None = None) -> None:
        world = dist.get_world_size()
        if process_group is not None and dist.get_world_size(process_group) != world:
            raise ValueError(
                "PipelineParallelGrid(process_group=...): a group of "
                f"{dist.get_world_size(process_group)} of the job's {world} ranks; the grid "
                "covers the whole job (DeepSpeed ignores the argument)"
            )
        if mesh is None:
            if topology is None:  # DeepSpeed's default: prime factors dealt to pipe, data
                factors = _prime_factors(dist.get_world_size())
                topology = PipeDataParallelTopology(
                    math.prod(factors[0::2]), math.prod(factors[1::2])
                )
            dims = parallel_dims(topology)
            if dims.world_size != dist.get_world_size():
                raise ValueError(
                    f"PipelineParallelGrid: the topology has {dims.world_size} ranks, the job "
                    f"{dist.get_world_size()}"
                )
            mesh = build_mesh(dims.tensor, dims.pipe)
        self.mesh = mesh
        self._topo = topology if topology is not None else mesh.dims.topology()
        dims = mesh.dims
        self.global_rank, self.world_size = mesh.rank, dims.world_size
        self.pipe_parallel_size, self.data_parallel_size = dims.pipe, dims.data
        self.model_parallel_size = self.slice_parallel_size = dims.tensor
        self.stage_id, self.data_parallel_id = mesh.pipe_rank, mesh.data_rank
        # DeepSpeed's rank lists of this rank's groups.
        self.pp_group = dims.pipe_ranks(mesh.data_rank, mesh.tensor_rank)
        self.dp_group = dims.data_ranks(mesh.tensor_rank, mesh.pipe_rank)
        self.slice_group = dims.tensor_ranks(mesh.data_rank, mesh.pipe_rank)
        alone = None
        if mesh.pipe_group is None or mesh.tensor_group is None:
            for rank in range(world):  # every rank creates every group, in one order
                group = dist.new_group([rank])
                if rank == mesh.rank:
                    alone = group
        mine = [mesh.pipe_group, mesh.tensor_group, mesh.model_group]
        self._pipe_group, self._slice_group, self._model_group = (
            alone if group is None else group for group in mine
        )

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **coords: int) -> int:
        """The global rank of ``stage_id`` at this rank's other coordinates (or ``coords``)."""
        here = self.mesh.dims.coordinates(self.global_rank)
        data = coords.pop("data", here[1])
        tensor = coords.pop("model", here[2])
        if coords:
            raise ValueError(f"stage_to_global: no axes {sorted(coords)} in this grid")
        return self.mesh.dims.rank_of(stage_id, data, tensor)

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        return self._pipe_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.mesh.get_data_parallel_group()

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    # "Model parallel" in DeepSpeed's grid: every rank of this copy of the model.
    def get_model_parallel_rank(self) -> int:
        return self.stage_id * self.mesh.dims.tensor + self.mesh.tensor_rank

    def get_model_parallel_world_size(self) -> int:
        return self.pipe_parallel_size * self.slice_parallel_size

    def get_model_parallel_group(self):
        return self._model_group

    # "Slice parallel": the tensor-parallel ranks (Megatron's tensor slicing).
    def get_slice_parallel_rank(self) -> int:
        return self.mesh.tensor_rank

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self):
        return self._slice_group

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size


def _prime_factors(n: int) -> list[int]:
    factors, candidate = [], 2
    while n > 1:
        while n % candidate == 0:
            factors.append(candidate)
            n //= candidate
        candidate += 1
    return factors


def build_mesh(tensor: int = 1, pipe: int = 1, sequence: int = 1) -> Mesh:
    """The mesh of the current job with tensor-parallel degree ``tensor``, ``pipe`` pipeline
    stages and sequence-parallel degree ``sequence``. Every rank must call it (it creates
    process groups) with the same degrees."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims(world, tensor, pipe, sequence)
    if dims.sequence > 1:
        return _sequence_mesh(dims, rank)
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


_job: tuple[Mesh, object] | None = None  # the last engine's mesh, and (weakly) the group then


def _forget_job() -> None:
    global _job
    _job = None  # its groups are destroyed: kept here, their threads would outlive them


on_destroy(_forget_job)


def use_mesh(mesh: Mesh) -> None:
    """Record ``mesh`` as the job's (``initialize`` does), for DeepSpeed's module-level group
    questions (``deepspeed.utils.groups``)."""
    global _job
    _job = (mesh, world_ref())


def job_mesh() -> Mesh:
    """The mesh the last engine of this process group was built on; without one, the job as
    data parallelism alone (no groups are made)."""
    if _job is not None and is_world(_job[1]):
        return _job[0]
    return Mesh(ParallelDims(dist.get_world_size()), dist.get_rank(), None, None)


def _sequence_mesh(dims: ParallelDims, rank: int) -> Mesh:
    """Sequence parallelism's mesh: runs of S consecutive ranks share sequences, every S-th
    rank forms a data-parallel group (every rank creates every group, in one order). Both are
    real groups even when one is the whole job or one rank (D = 1): attention talks over the
    first by name, and ``get_data_parallel_group`` answers the second, where None would mean
    the whole job."""
    sequence_group = data_group = None
    for d in range(dims.data):
        ranks = dims.sequence_ranks(d)
        group = dist.new_group(ranks)
        if rank in ranks:
            sequence_group = group
    for s in range(dims.sequence):
        ranks = dims.data_ranks(0, 0, sequence_rank=s)
        group = dist.new_group(ranks)
        if rank in ranks:
            data_group = group
    return Mesh(dims, rank, data_group=data_group, tensor_group=None, sequence_group=sequence_group)


def mesh_from_mpu(mpu) -> Mesh:
    """The mesh a Megatron-style ``mpu`` describes (``initialize(mpu=...)``): its data-parallel
    group and its tensor- (or model-) parallel group. The layout must be ours (tensor ranks
    consecutive), which Megatron's is; anything else is named. A ``Mesh``, or sequence
    parallelism's state (``zerolap.sequence_parallel.state``, DeepSpeed's ``parallel_state_sp``,
    which Accelerate passes), gives its own mesh."""
    if isinstance(mpu, Mesh):
        return mpu
    if callable(getattr(mpu, "current_mesh", None)):
        return mpu.current_mesh()
    # Megatron-DeepSpeed's mpu always has sequence-parallel groups, of one rank without it.
    sequence = getattr(mpu, "get_sequence_parallel_world_size", None)
    if callable(sequence) and sequence() > 1:
        raise TypeError(
            f"initialize(mpu=...): an mpu with sequence-parallel groups of {sequence()} ranks "
            "must be zerolap's (deepspeed.runtime.sequence_parallel.parallel_state_sp after "
            "initialize_sequence_parallel)"
        )
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
