"""Collectives on picklable Python objects: ``broadcast_object_list``, ``all_gather_object``,
``gather_object``.

Each object travels pickled, as a uint8 tensor, in two steps: first the sizes (fixed-shape int64
tensors, so every rank can allocate what it will receive before it receives it), then the
payload, padded to the longest piece where the collective needs equal pieces. Like DeepSpeed's
and torch's, these calls are synchronous; both steps wait through a ``Handle``, so a timeout
raises ``CommError``.

One comms-log record covers both steps. Its message is the pickled bytes the op delivers (the
list for a broadcast, every rank's object for a gather), its wire bytes what this rank sends in
both steps, padding included.

Unpickling runs code chosen by the sender: exchange objects only between processes you trust.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as torch_dist

from zerolap.comm.checks import GroupInfo, check_group, check_list, check_peer, check_root_list
from zerolap.comm.collectives import Group
from zerolap.comm.debug import agree
from zerolap.comm.flat_ops import all_gather_flat
from zerolap.comm.handle import Handle
from zerolap.comm.logger import logged
from zerolap.comm.volume import ring_wire_bytes

__all__ = ["all_gather_object", "broadcast_object_list", "gather_object"]


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    data = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    return torch.frombuffer(data, dtype=torch.uint8).to(device)


def _decode(payload: torch.Tensor) -> Any:
    return pickle.loads(payload.cpu().numpy().tobytes())


def _wait(op: str, info: GroupInfo, work: torch_dist.Work) -> None:
    Handle(work, op, info).wait()


def _device(info: GroupInfo, device: torch.device | str | None) -> torch.device:
    return info.device() if device is None else torch.device(device)


def _padded(payload: torch.Tensor, length: int) -> torch.Tensor:
    if payload.numel() == length:
        return payload
    out = torch.zeros(length, dtype=torch.uint8, device=payload.device)
    out[: payload.numel()] = payload
    return out


def _gather_sizes(op: str, info: GroupInfo, payload: torch.Tensor) -> list[int]:
    """Every rank's payload length, by an all-gather of one int64 each."""
    sizes = torch.empty(info.size, dtype=torch.int64, device=payload.device)
    mine = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
    _wait(op, info, all_gather_flat(sizes, mine, info.group, async_op=True))
    return sizes.tolist()


def broadcast_object_list(
    object_list: list[Any], src: int, group: Group = None, device: torch.device | None = None
) -> None:
    """Replace the entries of ``object_list`` on every rank with ``src``'s, in place.

    Every rank passes a list of the same length. Only ``src`` knows the length it sends, so a
    rank whose list differs learns it when ``src``'s header arrives: it still receives the
    payload (keeping the group in step), leaves its list as it was, and raises ``ValueError``.
    """
    op = "broadcast_object_list"
    info = check_group(op, group)
    check_list(op, "object_list", object_list, filled=True)
    check_peer(op, "src", src, info)
    agree(op, info, None, root=info.ranks.index(src))
    dev = _device(info, device)
    is_src = torch_dist.get_rank() == src
    payload = _encode(list(object_list), dev) if is_src else None
    header = torch.zeros(2, dtype=torch.int64, device=dev)  # [entries, payload bytes]
    if payload is not None:
        header[0], header[1] = len(object_list), payload.numel()
    with logged(op, info.size, dev) as record:
        _wait(op, info, torch_dist.broadcast(header, src, group=group, async_op=True))
        count, length = header.tolist()
        if payload is None:
            payload = torch.empty(length, dtype=torch.uint8, device=dev)
        _wait(op, info, torch_dist.broadcast(payload, src, group=group, async_op=True))
        if record is not None:
            record.message_bytes = length
            root = info.ranks.index(src)
            record.wire_bytes = ring_wire_bytes(
                "broadcast", header.numel() * 8 + length, info.size, group_rank=info.rank, root=root
            )
    if is_src:
        return
    if count != len(object_list):
        raise ValueError(
            f"{op}: object_list has {len(object_list)} entries on rank {torch_dist.get_rank()} "
            f"but src={src} sent {count}; every rank must pass a list of the same length"
        )
    object_list[:] = _decode(payload)


def all_gather_object(object_list: list[Any], obj: Any, group: Group = None) -> None:
    """Fill ``object_list`` (one entry per group rank) with every rank's ``obj``, in group-rank
    order."""
    op = "all_gather_object"
    info = check_group(op, group)
    check_list(op, "object_list", object_list, info.size, filled=True)
    agree(op, info, None)
    payload = _encode(obj, info.device())
    with logged(op, info.size, payload.device) as record:
        sizes = _gather_sizes(op, info, payload)
        longest = max(sizes)
        gathered = torch.empty(info.size * longest, dtype=torch.uint8, device=payload.device)
        padded = _padded(payload, longest)
        _wait(op, info, all_gather_flat(gathered, padded, group, async_op=True))
        if record is not None:
            record.message_bytes = sum(sizes)
            record.wire_bytes = ring_wire_bytes(
                "all_gather", gathered.numel() + 8 * info.size, info.size
            )
    for i, size in enumerate(sizes):
        object_list[i] = _decode(gathered[i * longest : i * longest + size])


def gather_object(
    obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, group: Group = None
) -> None:
    """Every rank's ``obj`` into ``object_gather_list`` (one entry per group rank, in group-rank
    order) on ``dst``; the other ranks pass no list."""
    op = "gather_object"
    info = check_group(op, group)
    check_peer(op, "dst", dst, info)
    is_dst = check_root_list(op, "object_gather_list", object_gather_list, "dst", dst, info)
    if is_dst:
        check_list(op, "object_gather_list", object_gather_list, info.size, filled=True)
    agree(op, info, None, root=info.ranks.index(dst))
    payload = _encode(obj, info.device())
    with logged(op, info.size, payload.device) as record:
        # Every rank learns the longest piece so that all send equal, padded pieces.
        sizes = _gather_sizes(op, info, payload)
        longest = max(sizes)
        padded = _padded(payload, longest)
        pieces = [torch.empty_like(padded) for _ in range(info.size)] if is_dst else None
        _wait(op, info, torch_dist.gather(padded, pieces, dst, group=group, async_op=True))
        if record is not None:
            record.message_bytes = sum(sizes)
            record.wire_bytes = ring_wire_bytes("all_gather", 8 * info.size, info.size) + (
                0 if is_dst else longest
            )
    if pieces is not None:
        for i, (piece, size) in enumerate(zip(pieces, sizes, strict=True)):
            object_gather_list[i] = _decode(piece[:size])  # type: ignore[index]
