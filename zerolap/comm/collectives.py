"""The collective and point-to-point ops of ``deepspeed.comm``, on ``torch.distributed``.

Each op follows the same four steps: check the arguments (nothing has moved yet), open a comms
log record when logging is on, launch the backend op asynchronously, and wrap its work in a
``Handle``. A synchronous call is the asynchronous one followed by ``wait()``, so both paths are
timed, finalised and reported on failure alike.

Two behaviours differ from plain torch on purpose:
* ``avg`` works on gloo (a sum, divided by the group size on completion);
* ``reduce`` leaves non-destination tensors unchanged (gloo writes partial sums into them), by
  reducing from a scratch copy on those ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as torch_dist

from zerolap.comm.checks import (
    GroupInfo,
    check_group,
    check_peer,
    check_same_dtype,
    check_sizes,
    check_tensor,
    check_tensor_list,
)
from zerolap.comm.debug import agree
from zerolap.comm.flat_ops import all_gather_flat, reduce_scatter_flat
from zerolap.comm.handle import Handle
from zerolap.comm.logger import COMMS_LOGGER
from zerolap.comm.reduce_ops import (
    ReduceOp,
    check_avg_dtype,
    native_op,
    needs_division,
    parse_reduce_op,
)
from zerolap.comm.volume import ring_wire_bytes

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "send",
]

Group = torch_dist.ProcessGroup | None


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def launch(
    op: str,
    info: GroupInfo,
    message: torch.Tensor | None,
    start: Callable[[], torch_dist.Work],
    async_op: bool,
    *,
    message_bytes: int | None = None,
    wire_bytes: int | None = None,
    root: int | None = None,
    value: object = None,
    finalize: Callable[[], None] | None = None,
    log_name: str | None = None,
    reduce_op=None,
    sized: bool = True,
    pairwise: bool = False,
) -> Handle | object:
    """Open ``op``'s log record, call ``start`` (which launches the backend op asynchronously)
    and wrap its work in a ``Handle``; wait here unless ``async_op``. The record's message is
    ``message``'s bytes unless ``message_bytes`` is given (0 with no message, as for a barrier),
    its wire bytes ``ring_wire_bytes`` of that unless ``wire_bytes`` is given; the record is
    named ``log_name`` when given (DeepSpeed's way of telling one caller's ops apart). Shared by
    every op module of ``zerolap.comm``. In debug mode a collective's call (``reduce_op``,
    ``root``, and ``message``'s size unless not ``sized`` and dtype) is first compared across
    the group (``zerolap.comm.debug``); a ``pairwise`` op (send, receive) is not."""
    if not pairwise:
        agree(op, info, message, reduce_op=reduce_op, root=root, sized=sized)
    record = None
    if COMMS_LOGGER.enabled:
        size = message_bytes
        if size is None:
            size = 0 if message is None else nbytes(message)
        wire = wire_bytes
        if wire is None:
            wire = ring_wire_bytes(op, size, info.size, group_rank=info.rank, root=root)
        device = info.device() if message is None else message.device
        record = COMMS_LOGGER.start(log_name or op, size, wire, info.size, device, collective=op)
    handle = Handle(
        start(), op, info, value=value, finalize=finalize, record=record, pairwise=pairwise
    )
    if record is not None:
        record.launched = time.perf_counter()
    if async_op:
        return handle
    handle.wait()
    return value


def _divider(tensor: torch.Tensor, op, info: GroupInfo) -> Callable[[], None] | None:
    if needs_division(op, info.backend):
        return lambda: tensor.div_(info.size)
    return None


def all_reduce(
    tensor: torch.Tensor,
    op=ReduceOp.SUM,
    group: Group = None,
    async_op=False,
    *,
    log_name: str | None = None,
):
    info = check_group("all_reduce", group)
    check_tensor("all_reduce", "tensor", tensor, info)
    op = parse_reduce_op(op)
    check_avg_dtype(op, tensor, "tensor")
    native = native_op(op, info.backend)
    return launch(
        "all_reduce",
        info,
        tensor,
        lambda: torch_dist.all_reduce(tensor, native, group=group, async_op=True),
        async_op,
        finalize=_divider(tensor, op, info),
        log_name=log_name,
        reduce_op=op,
    )


def broadcast(tensor: torch.Tensor, src: int, group: Group = None, async_op=False):
    info = check_group("broadcast", group)
    check_tensor("broadcast", "tensor", tensor, info)
    check_peer("broadcast", "src", src, info)
    return launch(
        "broadcast",
        info,
        tensor,
        lambda: torch_dist.broadcast(tensor, src, group=group, async_op=True),
        async_op,
        root=info.ranks.index(src),
    )


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group: Group = None, async_op=False):
    """Reduce onto ``dst``; every other rank's ``tensor`` is left as it was."""
    info = check_group("reduce", group)
    check_tensor("reduce", "tensor", tensor, info)
    check_peer("reduce", "dst", dst, info)
    op = parse_reduce_op(op)
    check_avg_dtype(op, tensor, "tensor")
    is_dst = torch_dist.get_rank() == dst
    # NCCL writes only the root's buffer; gloo scribbles partial sums on the others.
    target = tensor if is_dst or info.backend == "nccl" else tensor.clone()
    native = native_op(op, info.backend)
    return launch(
        "reduce",
        info,
        tensor,
        lambda: torch_dist.reduce(target, dst, native, group=group, async_op=True),
        async_op,
        root=info.ranks.index(dst),
        finalize=_divider(tensor, op, info) if is_dst else None,
        reduce_op=op,
    )


def all_gather(
    tensor_list, tensor: torch.Tensor | None = None, group: Group = None, async_op=False
):
    """``all_gather(tensor_list, tensor)`` fills ``tensor_list`` as torch does;
    ``all_gather(tensor)`` returns a new list of every rank's tensor (or, async, a handle whose
    ``value`` is that list)."""
    info = check_group("all_gather", group)
    returns_list = tensor is None
    if returns_list:
        if not isinstance(tensor_list, torch.Tensor):
            raise TypeError("all_gather: pass (tensor_list, tensor) or a single tensor")
        tensor = check_tensor("all_gather", "tensor", tensor_list, info)
        tensor_list = [torch.empty_like(tensor) for _ in range(info.size)]
    else:
        check_tensor("all_gather", "tensor", tensor, info)
        check_tensor_list("all_gather", "tensor_list", tensor_list, tensor, info)
    return launch(
        "all_gather",
        info,
        tensor,
        lambda: torch_dist.all_gather(tensor_list, tensor, group=group, async_op=True),
        async_op,
        message_bytes=nbytes(tensor) * info.size,
        value=tensor_list if returns_list else None,
    )


def all_gather_into_tensor(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Group = None, async_op=False
):
    """Every rank's ``input_tensor`` concatenated, in group-rank order, into ``output_tensor``."""
    op = "all_gather_into_tensor"
    info = check_group(op, group)
    check_tensor(op, "output_tensor", output_tensor, info)
    check_tensor(op, "input_tensor", input_tensor, info)
    check_same_dtype(op, "output_tensor", output_tensor, "input_tensor", input_tensor)
    check_sizes(
        op,
        "output_tensor",
        output_tensor.numel(),
        "input_tensor",
        input_tensor.numel(),
        info.size,
        gathers=True,
    )
    return launch(
        op,
        info,
        output_tensor,
        lambda: all_gather_flat(output_tensor, input_tensor, group, async_op=True),
        async_op,
    )


def reduce_scatter(
    output: torch.Tensor, input, op=ReduceOp.SUM, group: Group = None, async_op=False
):
    """Reduce, then keep this rank's piece. ``input`` is a list of one tensor per rank or one
    flat tensor of world_size x ``output.numel()`` elements."""
    if isinstance(input, torch.Tensor):
        return reduce_scatter_tensor(output, input, op, group, async_op)
    info = check_group("reduce_scatter", group)
    check_tensor("reduce_scatter", "output", output, info)
    check_tensor_list("reduce_scatter", "input", input, output, info)
    op = parse_reduce_op(op)
    check_avg_dtype(op, output, "output")
    native = native_op(op, info.backend)
    return launch(
        "reduce_scatter",
        info,
        output,
        lambda: torch_dist.reduce_scatter(output, list(input), native, group=group, async_op=True),
        async_op,
        message_bytes=nbytes(output) * info.size,
        finalize=_divider(output, op, info),
        reduce_op=op,
    )


def reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group: Group = None, async_op=False
):
    name = "reduce_scatter_tensor"
    info = check_group(name, group)
    check_tensor(name, "output", output, info)
    check_tensor(name, "input", input, info)
    check_same_dtype(name, "output", output, "input", input)
    check_sizes(name, "output", output.numel(), "input", input.numel(), info.size, gathers=False)
    op = parse_reduce_op(op)
    check_avg_dtype(op, output, "output")
    native = native_op(op, info.backend)
    return launch(
        name,
        info,
        input,
        lambda: reduce_scatter_flat(output, input, native, group, async_op=True),
        async_op,
        finalize=_divider(output, op, info),
        reduce_op=op,
    )


def isend(tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0) -> Handle:
    info = check_group("isend", group)
    check_tensor("isend", "tensor", tensor, info)
    check_peer("isend", "dst", dst, info, allow_self=False)
    return launch(  # type: ignore[return-value]
        "isend",
        info,
        tensor,
        lambda: torch_dist.isend(tensor, dst, group=group, tag=tag),
        True,
        pairwise=True,
    )


def irecv(tensor: torch.Tensor, src: int, group: Group = None, tag: int = 0) -> Handle:
    info = check_group("irecv", group)
    check_tensor("irecv", "tensor", tensor, info)
    check_peer("irecv", "src", src, info, allow_self=False)
    return launch(  # type: ignore[return-value]
        "irecv",
        info,
        tensor,
        lambda: torch_dist.irecv(tensor, src, group=group, tag=tag),
        True,
        pairwise=True,
    )


def send(tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0) -> None:
    isend(tensor, dst, group, tag).wait()


def recv(tensor: torch.Tensor, src: int | None = None, group: Group = None, tag: int = 0) -> int:
    """Receive into ``tensor`` from ``src`` (any rank when None); returns the sender's rank."""
    if src is not None:
        irecv(tensor, src, group, tag).wait()
        return src
    info = check_group("recv", group)
    check_tensor("recv", "tensor", tensor, info)
    works: list = []

    def start() -> torch_dist.Work:
        works.append(torch_dist.irecv(tensor, None, group=group, tag=tag))  # from any source
        return works[0]

    launch("irecv", info, tensor, start, True, pairwise=True).wait()
    return works[0]._source_rank()


def through_group_device(op: Callable, tensor: torch.Tensor, *, group: Group = None, **kwargs):
    """``op``, an in-place collective such as ``broadcast`` or ``all_reduce``, on ``tensor``
    wherever it lives: through a copy on the group's device when the backend cannot take it
    there (a host tensor under NCCL: offloaded state, a model not moved to its GPU yet)."""
    device = check_group("through_group_device", group).device()
    if tensor.device == device:
        op(tensor, group=group, **kwargs)
        return
    staged = tensor.to(device)
    op(staged, group=group, **kwargs)
    tensor.copy_(staged)
