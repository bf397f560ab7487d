"""Several tensors in one collective, and DeepSpeed's other names for the flat-tensor ops.

``all_reduce_coalesced`` and ``all_gather_coalesced`` pack their tensors into one flat buffer,
run one collective on it and unpack: one launch and one log record instead of one per tensor,
on every backend. The tensors share a dtype and device. With ``async_op=True`` the results are
unpacked into the caller's tensors by the handle's ``wait()``, the step where gloo's average
divides too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as torch_dist

from zerolap.comm.checks import GroupInfo, check_group, check_list, check_same_dtype, check_tensor
from zerolap.comm.collectives import (
    Group,
    all_gather_into_tensor,
    all_reduce,
    launch,
    reduce_scatter_tensor,
)
from zerolap.comm.flat_ops import all_gather_flat
from zerolap.comm.groups import require_initialized
from zerolap.comm.reduce_ops import (
    ReduceOp,
    check_avg_dtype,
    native_op,
    needs_division,
    parse_reduce_op,
)

__all__ = [
    "all_gather_coalesced",
    "all_reduce_coalesced",
    "allgather_fn",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "reduce_scatter_fn",
]


def _check_alike(op: str, name: str, tensors: Sequence[torch.Tensor], info: GroupInfo) -> None:
    """A non-empty list of tensors of one dtype and device, as one flat buffer needs."""
    check_list(op, name, tensors)
    if not tensors:
        raise ValueError(f"{op}: {name} is empty")
    first = check_tensor(op, f"{name}[0]", tensors[0], info)
    for i, t in enumerate(tensors):
        check_tensor(op, f"{name}[{i}]", t, info)
        check_same_dtype(op, f"{name}[{i}]", t, f"{name}[0]", first)
        if t.device != first.device:
            raise ValueError(f"{op}: {name}[{i}] is on {t.device} but {name}[0] on {first.device}")


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor], op=ReduceOp.SUM, group: Group = None, async_op: bool = False
):
    """``all_reduce`` of each tensor in ``tensors``, in place, as one collective."""
    name = "all_reduce_coalesced"
    info = check_group(name, group)
    _check_alike(name, "tensors", tensors, info)
    op = parse_reduce_op(op)
    check_avg_dtype(op, tensors[0], "tensors")
    flat = torch.cat([t.reshape(-1) for t in tensors])
    divides = needs_division(op, info.backend)

    def unpack() -> None:
        if divides:
            flat.div_(info.size)
        for t, piece in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            t.copy_(piece.view_as(t))

    native = native_op(op, info.backend)
    return launch(
        name,
        info,
        flat,
        lambda: torch_dist.all_reduce(flat, native, group=group, async_op=True),
        async_op,
        finalize=unpack,
        reduce_op=op,
    )


def all_gather_coalesced(
    output_tensors: Sequence[torch.Tensor],
    input_tensors: Sequence[torch.Tensor],
    group: Group = None,
    async_op: bool = False,
):
    """``all_gather_into_tensor(output_tensors[i], input_tensors[i])`` for every i, as one
    collective."""
    name = "all_gather_coalesced"
    info = check_group(name, group)
    _check_alike(name, "input_tensors", input_tensors, info)
    check_list(name, "output_tensors", output_tensors, len(input_tensors))
    for i, (out, inp) in enumerate(zip(output_tensors, input_tensors, strict=True)):
        check_tensor(name, f"output_tensors[{i}]", out, info)
        check_same_dtype(name, f"output_tensors[{i}]", out, f"input_tensors[{i}]", inp)
        if out.numel() != info.size * inp.numel():
            raise ValueError(
                f"{name}: output_tensors[{i}] has {out.numel()} elements but must have "
                f"world_size x input_tensors[{i}] = {info.size} x {inp.numel()} = "
                f"{info.size * inp.numel()}"
            )
    numels = [t.numel() for t in input_tensors]
    flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
    flat_out = torch.empty(info.size * flat_in.numel(), dtype=flat_in.dtype, device=flat_in.device)

    def unpack() -> None:
        # flat_out holds rank 0's inputs back to back, then rank 1's, ...
        by_rank = flat_out.view(info.size, flat_in.numel()).split(numels, dim=1)
        for out, piece, numel in zip(output_tensors, by_rank, numels, strict=True):
            out.view(info.size, numel).copy_(piece)

    return launch(
        name,
        info,
        flat_out,
        lambda: all_gather_flat(flat_out, flat_in, group, async_op=True),
        async_op,
        finalize=unpack,
    )


def inference_all_reduce(
    tensor: torch.Tensor, op=ReduceOp.SUM, group: Group = None, async_op: bool = False
) -> None:
    """DeepSpeed's all-reduce for inference layers: a synchronous ``all_reduce``, whatever
    ``async_op`` says (DeepSpeed's ignores it too; its CPU shared-memory kernel is not used
    here). Logged as ``all_reduce``, as DeepSpeed logs it."""
    all_reduce(tensor, op, group)


def allgather_fn(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Group = None, async_op=False
):
    """DeepSpeed's name for ``all_gather_into_tensor``."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def reduce_scatter_fn(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op=ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
):
    """DeepSpeed's name for ``reduce_scatter_tensor``."""
    return reduce_scatter_tensor(output_tensor, tensor, op, group, async_op)


def has_all_gather_into_tensor() -> bool:
    """DeepSpeed's capability probe: zerolap always has ``all_gather_into_tensor``."""
    require_initialized("has_all_gather_into_tensor")
    return True


def has_reduce_scatter_tensor() -> bool:
    """DeepSpeed's capability probe: zerolap always has ``reduce_scatter_tensor``."""
    require_initialized("has_reduce_scatter_tensor")
    return True


def has_all_reduce_coalesced() -> bool:
    """DeepSpeed's capability probe: zerolap always has ``all_reduce_coalesced``."""
    require_initialized("has_all_reduce_coalesced")
    return True
