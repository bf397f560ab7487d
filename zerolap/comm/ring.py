"""Ring all-reduce, built from its two phases on point-to-point messages.

A tensor of K elements is split into N chunks (``even_chunks``). Group rank r sends to r+1 and
receives from r-1.

* ``ring_reduce_scatter``: in step s (0..N-2) rank r sends chunk (r-s-1) and adds the incoming
  chunk (r-s-2) into its own copy. After N-1 steps chunk r holds the full reduction on rank r.
* ``ring_all_gather``: in step s rank r sends chunk (r-s) and overwrites chunk (r-s-1) with what
  arrives. After N-1 steps every rank holds every chunk.

Each phase sends every chunk but one, K(N-1)/N elements per rank when N divides K, so the
all-reduce moves 2K(N-1)/N: the bandwidth-optimal volume. This matters on gloo, whose own
``reduce_scatter_tensor`` moves as many bytes as a full all-reduce; ZeRO's gradient reduce-scatter
uses these phases there.

Asynchronous calls run on one worker thread per group, so the steps proceed while the caller
computes (torch kernels and gloo release the GIL). Synchronous calls go through the same worker,
which keeps every ring op on a group in one order on all ranks.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as torch_dist

from zerolap.comm.checks import GroupInfo, check_group, check_tensor
from zerolap.comm.chunking import even_chunks
from zerolap.comm.handle import Handle
from zerolap.comm.logger import COMMS_LOGGER
from zerolap.comm.reduce_ops import ReduceOp, check_avg_dtype, combine_into, parse_reduce_op

__all__ = ["ring_all_gather", "ring_all_reduce", "ring_reduce_scatter"]

# Point-to-point tag for ring traffic, apart from tag 0 that user sends default to.
RING_TAG = 0x5A10

_workers: dict[int, ThreadPoolExecutor] = {}
_workers_lock = threading.Lock()


def _worker(group: torch_dist.ProcessGroup | None) -> ThreadPoolExecutor:
    key = id(group)
    with _workers_lock:
        if key not in _workers:
            _workers[key] = ThreadPoolExecutor(1, thread_name_prefix="zerolap-ring")
        return _workers[key]


class _Ring:
    """One rank's view of the ring: neighbours, chunk bounds, and a bytes-sent counter."""

    def __init__(self, tensor: torch.Tensor, info: GroupInfo) -> None:
        self.flat = tensor.view(-1)
        self.info = info
        self.n = info.size
        self.r = info.rank
        self.right = info.ranks[(self.r + 1) % self.n]
        self.left = info.ranks[(self.r - 1) % self.n]
        self.bounds = even_chunks(self.flat.numel(), self.n)
        self.sent_bytes = 0

    def chunk(self, i: int) -> torch.Tensor:
        start, end = self.bounds[i % self.n]
        return self.flat[start:end]

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Send ``send`` right while receiving ``recv`` from the left; empty chunks skip."""
        group = self.info.group
        works = []
        if send.numel():
            works.append(torch_dist.isend(send, self.right, group=group, tag=RING_TAG))
            self.sent_bytes += send.numel() * send.element_size()
        if recv.numel():
            works.append(torch_dist.irecv(recv, self.left, group=group, tag=RING_TAG))
        for work in works:
            work.wait()

    def reduce_scatter(self, op) -> torch.Tensor:
        largest = max(end - start for start, end in self.bounds)
        scratch = torch.empty(largest, dtype=self.flat.dtype, device=self.flat.device)
        for s in range(self.n - 1):
            incoming = self.chunk(self.r - s - 2)
            received = scratch[: incoming.numel()]
            self.exchange(self.chunk(self.r - s - 1), received)
            combine_into(op, incoming, received)
        mine = self.chunk(self.r)
        if op == ReduceOp.AVG:
            mine.div_(self.n)
        return mine

    def all_gather(self) -> None:
        for s in range(self.n - 1):
            self.exchange(self.chunk(self.r - s), self.chunk(self.r - s - 1))


def _run(name: str, tensor: torch.Tensor, group, async_op: bool, body):
    info = check_group(name, group)
    check_tensor(name, "tensor", tensor, info)
    ring = _Ring(tensor, info)
    record = None
    if COMMS_LOGGER.enabled:
        nbytes = tensor.numel() * tensor.element_size()
        record = COMMS_LOGGER.start(name, nbytes, 0, info.size, tensor.device)

    def work():
        value = body(ring)
        if record is not None:
            record.wire_bytes = ring.sent_bytes
        return value

    if info.size == 1:
        future: Future = Future()
        future.set_result(work())
    else:
        future = _worker(group).submit(work)
    handle = Handle(future, lambda: info.describe(name), record=record)
    if async_op:
        future.add_done_callback(lambda f: setattr(handle, "value", f.result()))
        return handle
    handle.wait()
    return future.result()


def ring_reduce_scatter(tensor: torch.Tensor, op="sum", group=None, async_op: bool = False):
    """Reduce ``tensor`` across the group so that chunk r of ``even_chunks(numel, N)`` holds the
    result on group rank r; returns that chunk (a view; the other chunks are left as scratch)."""
    op = parse_reduce_op(op)
    check_avg_dtype(op, tensor, "tensor")
    return _run(
        "ring_reduce_scatter", tensor, group, async_op, lambda ring: ring.reduce_scatter(op)
    )


def ring_all_gather(tensor: torch.Tensor, group=None, async_op: bool = False):
    """Fill every chunk of ``tensor`` from its owner: group rank r contributes chunk r of
    ``even_chunks(numel, N)``. Returns ``tensor``."""
    return _run(
        "ring_all_gather", tensor, group, async_op, lambda ring: (ring.all_gather(), tensor)[1]
    )


def ring_all_reduce(tensor: torch.Tensor, op="sum", group=None, async_op: bool = False):
    """All-reduce ``tensor`` in place as reduce-scatter then all-gather. Returns ``tensor``."""
    op = parse_reduce_op(op)
    check_avg_dtype(op, tensor, "tensor")

    def both(ring: _Ring) -> torch.Tensor:
        ring.reduce_scatter(op)
        ring.all_gather()
        return tensor

    return _run("ring_all_reduce", tensor, group, async_op, both)
