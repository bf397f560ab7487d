"""Argument checks run before any byte moves.

A collective with mismatched arguments hangs or corrupts memory on some backends; these checks
raise first, naming the op, the tensor and the sizes, so the process group stays usable.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch
import torch.distributed as torch_dist

from zerolap.comm.groups import backend_of, group_ranks, is_world, require_initialized, world_ref

__all__ = [
    "GroupInfo",
    "buffer_device",
    "check_group",
    "check_list",
    "check_peer",
    "check_root_list",
    "check_splits",
    "check_tensor",
    "check_tensor_list",
]


class GroupInfo:
    """The facts about a group that every op needs, looked up once per call."""

    __slots__ = ("backend", "group", "rank", "ranks", "size")

    def __init__(self, group: torch_dist.ProcessGroup | None) -> None:
        self.group = group
        self.ranks = group_ranks(group)
        self.size = len(self.ranks)
        self.rank = torch_dist.get_rank(group) if group is not None else torch_dist.get_rank()
        self.backend = backend_of(group)

    def device(self) -> torch.device:
        """Where the group's own buffers (sizes, pickled objects, barriers) live."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def describe(self, op: str) -> str:
        return (
            f"rank {torch_dist.get_rank()} waited for {op} on group ranks {self.ranks} "
            f"({self.backend}) and it"
        )


# A group's members never change, so its facts are looked up once (each lookup is a call into
# torch that costs microseconds on every collective otherwise). Cleared when groups go away:
# by zerolap's destroy_process_group, or on the first op after torch's own destroy and a new
# group (Accelerate's end_training destroys through torch), whose ranks may differ.
_group_infos: dict[object, GroupInfo] = {}
_infos_world = None  # the default group the facts are of, weakly (``world_ref``)


def forget_groups() -> None:
    global _infos_world
    _group_infos.clear()
    _infos_world = None


def buffer_device(group: torch_dist.ProcessGroup | None = None) -> torch.device:
    """Where a small tensor must live to be sent over ``group`` (CUDA for NCCL, else CPU):
    for the engine's own flags and digests."""
    return check_group("buffer_device", group).device()


def check_group(op: str, group: torch_dist.ProcessGroup | None) -> GroupInfo:
    global _infos_world
    require_initialized(op)
    if not is_world(_infos_world):
        _group_infos.clear()
        _infos_world = world_ref()
    info = _group_infos.get(group)
    if info is not None:
        return info
    if group is not None and torch_dist.get_rank(group) < 0:
        raise ValueError(
            f"{op}: rank {torch_dist.get_rank()} is not a member of group ranks "
            f"{group_ranks(group)}"
        )
    info = _group_infos[group] = GroupInfo(group)
    return info


def check_tensor(op: str, name: str, tensor: object, info: GroupInfo) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(
            f"{op}: {name} (shape {tuple(tensor.shape)}) is not contiguous; call .contiguous()"
        )
    if info.backend == "nccl" and tensor.device.type != "cuda":
        raise ValueError(
            f"{op}: {name} is on {tensor.device} but the group's backend is nccl, which needs "
            "CUDA tensors; move it with .cuda() or use a gloo group"
        )
    return tensor


def check_tensor_list(
    op: str, name: str, tensors: Sequence[torch.Tensor], like: torch.Tensor, info: GroupInfo
) -> None:
    """``tensors`` holds one tensor per group rank, each with ``like``'s numel and dtype."""
    check_list(op, name, tensors)
    if len(tensors) != info.size:
        raise ValueError(
            f"{op}: {name} has {len(tensors)} tensors but the group has {info.size} ranks"
        )
    for i, t in enumerate(tensors):
        check_tensor(op, f"{name}[{i}]", t, info)
        if t.numel() != like.numel() or t.dtype != like.dtype:
            raise ValueError(
                f"{op}: {name}[{i}] has {t.numel()} elements of {t.dtype}, expected "
                f"{like.numel()} of {like.dtype}"
            )


def check_same_dtype(op: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: {a_name} is {a.dtype} but {b_name} is {b.dtype}")


def check_sizes(
    op: str, out_name: str, out_numel: int, in_name: str, in_numel: int, n: int, gathers: bool
) -> None:
    """The flat side holds exactly ``n`` times the per-rank side's elements."""
    flat, piece = (out_numel, in_numel) if gathers else (in_numel, out_numel)
    if flat != n * piece:
        flat_name, piece_name = (out_name, in_name) if gathers else (in_name, out_name)
        raise ValueError(
            f"{op}: {flat_name} has {flat} elements but must have world_size x {piece_name} = "
            f"{n} x {piece} = {n * piece}"
        )


def check_peer(op: str, role: str, peer: int, info: GroupInfo, *, allow_self: bool = True) -> None:
    """``peer`` is a global rank that belongs to the group (torch's convention for src/dst)."""
    if not isinstance(peer, int) or isinstance(peer, bool):
        raise TypeError(f"{op}: {role} must be an int rank, got {peer!r}")
    if peer not in info.ranks:
        raise ValueError(f"{op}: {role}={peer} is not a member of group ranks {info.ranks}")
    if not allow_self and peer == torch_dist.get_rank():
        raise ValueError(f"{op}: {role}={peer} is this rank itself")


def check_list(
    op: str, name: str, value: object, length: int | None = None, *, filled: bool = False
) -> None:
    """``value`` is a list (or tuple), of ``length`` entries when given (one per group rank);
    a list the op ``filled`` in place cannot be a tuple."""
    if not isinstance(value, list if filled else (list, tuple)):
        raise TypeError(f"{op}: {name} must be a list, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise ValueError(f"{op}: {name} has {len(value)} entries but the group has {length} ranks")


def check_root_list(
    op: str, name: str, value: object, role: str, root: int, info: GroupInfo
) -> bool:
    """Rooted ops (gather, scatter) take a per-rank list on the root only, as torch does.
    Returns whether this rank is the root, where ``value`` is required (the caller checks its
    entries); elsewhere it must be None or empty."""
    is_root = torch_dist.get_rank() == root
    if is_root and value is None:
        raise ValueError(
            f"{op}: this rank is the {role} ({role}={root}) and must pass {name}, one entry per "
            f"group rank ({info.size})"
        )
    empty = value is None or (isinstance(value, (list, tuple)) and len(value) == 0)
    if not is_root and not empty:
        raise ValueError(
            f"{op}: {name} is given on rank {torch_dist.get_rank()}, which is not the {role} "
            f"({role}={root}); pass it on the {role} only"
        )
    return is_root


def rows_of(op: str, name: str, tensor: torch.Tensor) -> tuple[int, int]:
    """``tensor``'s rows (dim 0) and the elements in each row."""
    if tensor.dim() == 0:
        raise ValueError(f"{op}: {name} is a 0-dim tensor; it needs a dim 0 to split along")
    return tensor.shape[0], math.prod(tensor.shape[1:])


def check_splits(
    op: str, name: str, splits: Sequence[int] | None, tensor_name: str, rows: int, n: int
) -> list[int]:
    """Rows of a tensor of ``rows`` rows going to (or coming from) each of ``n`` group ranks:
    ``splits`` when given, else an even split."""
    if splits is None:
        if rows % n:
            raise ValueError(
                f"{op}: {tensor_name} has {rows} rows (dim 0), which do not split evenly over "
                f"{n} ranks; pass {name}"
            )
        return [rows // n] * n
    check_list(op, name, splits, n)
    try:
        sizes = [operator.index(s) for s in splits]
    except TypeError:
        raise TypeError(f"{op}: {name}={list(splits)} must hold ints") from None
    if any(s < 0 for s in sizes):
        raise ValueError(f"{op}: {name}={sizes} has a negative size")
    if sum(sizes) != rows:
        raise ValueError(
            f"{op}: {name}={sizes} sums to {sum(sizes)} rows but {tensor_name} has {rows} rows "
            "(dim 0)"
        )
    return sizes
