"""Argument checks run before any byte moves.

A collective with mismatched arguments hangs or corrupts memory on some backends; these checks
raise first, naming the op, the tensor and the sizes, so the process group stays usable.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as torch_dist

from zerolap.comm.groups import backend_of, group_ranks, require_initialized

__all__ = ["GroupInfo", "check_group", "check_peer", "check_tensor", "check_tensor_list"]


class GroupInfo:
    """The facts about a group that every op needs, looked up once per call."""

    __slots__ = ("backend", "group", "rank", "ranks", "size")

    def __init__(self, group: torch_dist.ProcessGroup | None) -> None:
        self.group = group
        self.ranks = group_ranks(group)
        self.size = len(self.ranks)
        self.rank = torch_dist.get_rank(group) if group is not None else torch_dist.get_rank()
        self.backend = backend_of(group)

    def describe(self, op: str) -> str:
        return (
            f"rank {torch_dist.get_rank()} waited for {op} on group ranks {self.ranks} "
            f"({self.backend}) and it"
        )


# A group's members never change, so its facts are looked up once (each lookup is a call into
# torch that costs microseconds on every collective otherwise). Cleared when groups go away.
_group_infos: dict[object, GroupInfo] = {}


def forget_groups() -> None:
    _group_infos.clear()


def check_group(op: str, group: torch_dist.ProcessGroup | None) -> GroupInfo:
    require_initialized(op)
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
