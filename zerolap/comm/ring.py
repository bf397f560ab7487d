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
computes (torch kernels and gloo release the GIL). A synchronous call runs on the caller's thread
when the worker has nothing queued (a thread hop costs latency on a small machine) and queues
behind the worker's ops otherwise: either way every ring op on a group keeps one order on all
ranks.
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


class _Channel:
    """Per group: the worker thread, how many ops it has queued, and a reusable scratch buffer
    (a fresh one per call would map new pages every time: half the cost at 64 MiB)."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="zerolap-ring")
        self.queued = 0
        self.lock = threading.Lock()
        self._scratch: dict[tuple, torch.Tensor] = {}

    def scratch(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, like.device)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._scratch[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]

    def submit(self, fn) -> Future:
        with self.lock:
            self.queued += 1
        future = self.executor.submit(fn)
        future.add_done_callback(self._done)
        return future

    def _done(self, _: Future) -> None:
        with self.lock:
            self.queued -= 1

    def idle(self) -> bool:
        with self.lock:
            return self.queued == 0


_channels: dict[int, _Channel] = {}
_channels_lock = threading.Lock()


def _channel(group: torch_dist.ProcessGroup | None) -> _Channel:
    key = id(group)
    with _channels_lock:
        if key not in _channels:
            _channels[key] = _Channel()
        return _channels[key]


class _Ring:
    """One rank's view of the ring: neighbours, chunk bounds, and a bytes-sent counter."""

    def __init__(self, tensor: torch.Tensor, info: GroupInfo, channel: _Channel) -> None:
        self.flat = tensor.view(-1)
        self.channel = channel
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
        scratch = self.channel.scratch(largest, self.flat)
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
    channel = _channel(group)
    ring = _Ring(tensor, info, channel)
    record = None
    if COMMS_LOGGER.enabled:
        nbytes = tensor.numel() * tensor.element_size()
        record = COMMS_LOGGER.start(name, nbytes, 0, info.size, tensor.device)

    def work():
        value = body(ring)
        if record is not None:
            record.wire_bytes = ring.sent_bytes
        return value

    if info.size == 1 or (not async_op and channel.idle()):
        future: Future = Future()
        try:
            future.set_result(work())
        except Exception as err:
            future.set_exception(err)
    else:
        future = channel.submit(work)
    handle = Handle(future, lambda: info.describe(name), record=record)
    if async_op:
        return handle  # its value (the result) is set by wait()
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
