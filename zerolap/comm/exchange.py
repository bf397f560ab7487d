"""Ops that hand each rank its own piece: gather, scatter and the all-to-alls.

They follow ``collectives``' four steps (check, open a log record, launch async, wrap in a
``Handle``). Roots (``dst``, ``src``) are global ranks, as in torch. Only what one rank can see is
checked before anything moves: list lengths against the group, sizes and dtypes against this
rank's own tensors, split sizes against this rank's rows and against each other for what a rank
sends itself. That rank i's ``input_split_sizes[j]`` equals rank j's ``output_split_sizes[i]``
for i != j is the caller's contract, as in torch and DeepSpeed: checking it would cost an
exchange per call, and gloo does not check it either (a receiver expecting more rows than were
sent gets the rows that came and keeps the rest of its buffer as it was).

Log records (see ``volume``): a gather's message is every rank's piece, a scatter's the pieces
scattered, an all-to-all's this rank's input; wire bytes count what this rank sends to others.
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist

from zerolap.comm.checks import (
    check_group,
    check_list,
    check_peer,
    check_root_list,
    check_same_dtype,
    check_splits,
    check_tensor,
    check_tensor_list,
    rows_of,
)
from zerolap.comm.collectives import Group, launch, nbytes

__all__ = ["all_to_all", "all_to_all_single", "gather", "scatter"]


def _rooted(op: str, tensor, pieces, list_name: str, role: str, root: int, group, async_op, call):
    """Gather and scatter: the same checks and record; ``call(pieces)`` launches torch's op."""
    info = check_group(op, group)
    check_tensor(op, "tensor", tensor, info)
    check_peer(op, role, root, info)
    if check_root_list(op, list_name, pieces, role, root, info):
        check_tensor_list(op, list_name, pieces, tensor, info)
    else:
        pieces = None
    return launch(
        op,
        info,
        tensor,
        lambda: call(pieces),
        async_op,
        message_bytes=nbytes(tensor) * info.size,
        root=info.ranks.index(root),
    )


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: Group = None,
    async_op: bool = False,
):
    """Every rank's ``tensor`` into ``gather_list`` (one tensor per group rank, in group-rank
    order) on ``dst``; the other ranks pass no list."""

    def call(pieces):
        return torch_dist.gather(tensor, pieces, dst, group=group, async_op=True)

    return _rooted("gather", tensor, gather_list, "gather_list", "dst", dst, group, async_op, call)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: Group = None,
    async_op: bool = False,
):
    """``src``'s ``scatter_list[i]`` into group rank i's ``tensor``; the other ranks pass no
    list."""

    def call(pieces):
        return torch_dist.scatter(tensor, pieces, src, group=group, async_op=True)

    return _rooted(
        "scatter", tensor, scatter_list, "scatter_list", "src", src, group, async_op, call
    )


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Group = None,
    async_op: bool = False,
):
    """Rows (dim 0) of ``tensor`` go to the group's ranks in order, ``input_split_sizes[j]`` of
    them to group rank j (an even split when None); ``output`` receives
    ``output_split_sizes[j]`` rows from group rank j, in group-rank order."""
    op = "all_to_all_single"
    info = check_group(op, group)
    check_tensor(op, "output", output, info)
    check_tensor(op, "tensor", tensor, info)
    check_same_dtype(op, "output", output, "tensor", tensor)
    in_rows, in_row_numel = rows_of(op, "tensor", tensor)
    out_rows, out_row_numel = rows_of(op, "output", output)
    if in_row_numel != out_row_numel:
        raise ValueError(
            f"{op}: output rows (shape {tuple(output.shape)}) hold {out_row_numel} elements but "
            f"tensor rows (shape {tuple(tensor.shape)}) hold {in_row_numel}"
        )
    sends = check_splits(op, "input_split_sizes", input_split_sizes, "tensor", in_rows, info.size)
    receives = check_splits(
        op, "output_split_sizes", output_split_sizes, "output", out_rows, info.size
    )
    me = info.rank
    if sends[me] != receives[me]:
        raise ValueError(
            f"{op}: this rank (group rank {me}) sends itself input_split_sizes[{me}]={sends[me]} "
            f"rows but expects output_split_sizes[{me}]={receives[me]} from itself"
        )
    row_bytes = in_row_numel * tensor.element_size()
    return launch(
        op,
        info,
        tensor,
        lambda: torch_dist.all_to_all_single(
            output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=True
        ),
        async_op,
        wire_bytes=row_bytes * (in_rows - sends[info.rank]),
        sized=False,  # each rank sends what it has
    )


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: Group = None,
    async_op: bool = False,
):
    """``input_tensor_list[j]`` goes to group rank j; ``output_tensor_list[j]`` receives group
    rank j's piece for this rank. Pieces may differ in size; all share one dtype.

    gloo's own list all-to-all takes equal pieces only, so the pieces travel packed through one
    ``all_to_all_single`` and are unpacked into ``output_tensor_list`` on completion (by
    ``wait()`` for an async call)."""
    op = "all_to_all"
    info = check_group(op, group)
    lists = {"output_tensor_list": output_tensor_list, "input_tensor_list": input_tensor_list}
    for name, tensors in lists.items():
        check_list(op, name, tensors, info.size)
    first = check_tensor(op, "input_tensor_list[0]", input_tensor_list[0], info)
    for name, tensors in lists.items():
        for i, t in enumerate(tensors):
            check_tensor(op, f"{name}[{i}]", t, info)
            check_same_dtype(op, f"{name}[{i}]", t, "input_tensor_list[0]", first)
    sends = [t.numel() for t in input_tensor_list]
    receives = [t.numel() for t in output_tensor_list]
    packed_in = torch.cat([t.reshape(-1) for t in input_tensor_list])
    packed_out = torch.empty(sum(receives), dtype=first.dtype, device=first.device)

    def unpack() -> None:
        pieces = packed_out.split(receives)
        for out, piece in zip(output_tensor_list, pieces, strict=True):
            out.copy_(piece.view_as(out))

    return launch(
        op,
        info,
        packed_in,
        lambda: torch_dist.all_to_all_single(
            packed_out, packed_in, receives, sends, group=group, async_op=True
        ),
        async_op,
        wire_bytes=nbytes(packed_in) - nbytes(input_tensor_list[info.rank]),
        finalize=unpack,
        sized=False,
    )
