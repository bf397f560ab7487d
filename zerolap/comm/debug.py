"""Debug mode: every collective's arguments compared across its group before it runs.

Ranks that call different collectives, or the same one with different sizes, dtypes, reduction
ops or roots, get wrong results silently (an all-reduce with ``sum`` on one rank and ``max`` on
another returns a value; a broadcast of 4 elements into 6 leaves the tail stale) or abort in
C++ with no Python traceback. In debug mode each collective first all-gathers a fingerprint of
its call (op, reduction, root, element count, dtype: five integers) over its group; when they
differ every rank raises ``CollectiveMismatch`` naming what each rank called, and the group
stays usable (the fingerprints themselves always match). The cost is one small all-gather per
collective, so it is off unless ``ZEROLAP_DEBUG_COLLECTIVES=1`` (or torch's
``TORCH_DISTRIBUTED_DEBUG=DETAIL``) is set when the process group starts. Point-to-point sends
and receives pair two ranks and are not checked.
"""

from __future__ import annotations

import os
import zlib

import torch
import torch.distributed as torch_dist

from zerolap.comm.flat_ops import all_gather_flat
from zerolap.comm.handle import CommError, Handle

__all__ = ["CollectiveMismatch", "agree", "configure_from_env"]

_REDUCTIONS = ("sum", "avg", "product", "min", "max")
_REDUCE_OPS = tuple(getattr(torch_dist.ReduceOp, name.upper()) for name in _REDUCTIONS)
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)

# Every collective of zerolap.comm, so that a rank can name what another rank called.
_OPS = (
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "scatter",
)

_enabled = False


class CollectiveMismatch(CommError):
    """Ranks of a group called different collectives, or one with different arguments."""


def configure_from_env() -> None:
    """Read the switch (``init_distributed``)."""
    global _enabled
    _enabled = (
        os.environ.get("ZEROLAP_DEBUG_COLLECTIVES", "0") not in ("", "0")
        or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    )


def _code(op: str) -> int:
    return _OPS.index(op) if op in _OPS else len(_OPS) + (zlib.crc32(op.encode()) & 0xFFFFFF)


def _describe(row: list[int]) -> str:
    op_code, reduction, root, numel, dtype = row
    text = _OPS[op_code] if op_code < len(_OPS) else f"an op unknown here (code {op_code})"
    if reduction >= 0:
        text += f"({_REDUCTIONS[reduction]})"
    if root >= 0:
        text += f" rooted at group rank {root}"
    if numel >= 0:
        text += f" of {numel} {str(_DTYPES[dtype]).removeprefix('torch.') if dtype >= 0 else ''}"
    return text.rstrip()


def agree(
    op: str,
    info,
    tensor: torch.Tensor | None,
    *,
    reduce_op=None,
    root: int | None = None,
    sized: bool = True,
) -> None:
    """In debug mode: raise ``CollectiveMismatch`` on every rank of ``info``'s group unless all
    of them are making this same call. ``sized``: whether the element count must match too."""
    if not _enabled or info.size == 1:
        return
    numel = tensor.numel() if tensor is not None and sized else -1
    dtype = _DTYPES.index(tensor.dtype) if tensor is not None and tensor.dtype in _DTYPES else -1
    reduction = _REDUCE_OPS.index(reduce_op) if reduce_op is not None else -1
    mine = [_code(op), reduction, -1 if root is None else root, numel, dtype]
    device = info.device()
    rows = torch.empty(info.size * len(mine), dtype=torch.int64, device=device)
    work = all_gather_flat(
        rows, torch.tensor(mine, dtype=torch.int64, device=device), info.group, async_op=True
    )
    Handle(work, f"{op} (debug mode's check)", info).wait()
    rows = rows.view(info.size, len(mine)).tolist()
    if all(row == mine for row in rows):
        return
    calls = "; ".join(
        f"rank {rank} calls {_describe(row)}" for rank, row in zip(info.ranks, rows, strict=True)
    )
    raise CollectiveMismatch(f"collective mismatch on group ranks {info.ranks}: {calls}")
