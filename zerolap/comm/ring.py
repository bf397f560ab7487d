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

A failure must not spread as wrong data. Each op's messages carry a tag of their own (the op's
number on its group, the same on every rank), so a message of one op is never taken by
another's receive: with one shared tag, a rank whose op failed half-way would go on to the next
queued op and send its chunks to a neighbour still waiting in the failed one, which gloo
answers by aborting the process. And after a failure the group's channel refuses every later
ring op, naming the first failure, instead of sending anything more.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as torch_dist

from zerolap.comm.checks import GroupInfo, check_group, check_tensor
from zerolap.comm.chunking import even_chunks
from zerolap.comm.debug import agree
from zerolap.comm.handle import Handle
from zerolap.comm.logger import COMMS_LOGGER
from zerolap.comm.reduce_ops import ReduceOp, check_avg_dtype, combine_into, parse_reduce_op

__all__ = ["ring_all_gather", "ring_all_reduce", "ring_reduce_scatter"]

# Point-to-point tags of ring traffic: RING_TAG + the op's number modulo RING_TAGS, far from
# tag 0 that user sends default to. Ops more than RING_TAGS apart cannot be in flight together.
RING_TAG = 0x5A100000
RING_TAGS = 1 << 16


class RingFailed(RuntimeError):
    """A ring op on this group failed earlier; the group's ring traffic is out of step."""


class _Channel:
    """Per group: the worker thread, how many ops it has queued, and a reusable scratch buffer
    (a fresh one per call would map new pages every time: half the cost at 64 MiB)."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="zerolap-ring")
        self.queued = 0
        self.lock = threading.Lock()
        self._scratch: dict[tuple, torch.Tensor] = {}
        self.ops = 0  # ring ops issued on the group: the next one's number
        self.failure: str | None = None  # the first failed op's error, once one failed

    def next_tag(self) -> int:
        """The tag of a new op's messages (called in issue order, on the caller's thread)."""
        tag = RING_TAG + self.ops % RING_TAGS
        self.ops += 1
        return tag

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


def forget_channels() -> None:
    """The groups are gone (``destroy_process_group``): their channels, failures included,
    must not pass to new groups that reuse an id."""
    with _channels_lock:
        for channel in _channels.values():
            channel.executor.shutdown(wait=False)
        _channels.clear()


def _channel(group: torch_dist.ProcessGroup | None) -> _Channel:
    key = id(group)
    with _channels_lock:
        if key not in _channels:
            _channels[key] = _Channel()
        return _channels[key]


class _Ring:
    """One rank's view of the ring: neighbours, chunk bounds, and a bytes-sent counter."""

    def __init__(self, tensor: torch.Tensor, info: GroupInfo, channel: _Channel, tag: int) -> None:
        self.flat = tensor.view(-1)
        self.channel = channel
        self.tag = tag
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
            work = torch_dist.isend(send, self.right, group=group, tag=self.tag)
            works.append((work, f"sending to rank {self.right}", self.right))
            self.sent_bytes += send.numel() * send.element_size()
        if recv.numel():
            work = torch_dist.irecv(recv, self.left, group=group, tag=self.tag)
            works.append((work, f"receiving from rank {self.left}", self.left))
        for work, what, peer in works:
            try:
                work.wait()
            except RuntimeError as err:
                raise RuntimeError(f"{what}: {err}{_peer_gone(str(err), peer)}") from err

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


def _peer_gone(message: str, peer: int) -> str:
    """What a lost connection says about the peer: gloo names only its address."""
    if "closed by peer" in message or "reset by peer" in message:
        return f" (rank {peer} closed the connection: it exited or died)"
    return ""


def _run(
    name: str, tensor: torch.Tensor, group, async_op: bool, body, reduce_op=None, prepare=None
):
    info = check_group(name, group)
    check_tensor(name, "tensor", tensor, info)
    agree(name, info, tensor, reduce_op=reduce_op)
    channel = _channel(group)
    ring = _Ring(tensor, info, channel, channel.next_tag())
    record = None
    if COMMS_LOGGER.enabled:
        nbytes = tensor.numel() * tensor.element_size()
        record = COMMS_LOGGER.start(name, nbytes, 0, info.size, tensor.device)

    def work():
        if prepare is not None:  # first, even on a failed channel: it may release resources
            try:
                prepare()
            except Exception as err:
                channel.failure = channel.failure or f"{name}: {err}"
                raise
        if channel.failure is not None:
            raise RingFailed(
                f"not started: an earlier ring op on this group failed: {channel.failure}"
            )
        try:
            value = body(ring)
        except Exception as err:
            channel.failure = channel.failure or f"{name}: {err}"
            raise
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
    handle = Handle(future, name, info, record=record)
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
        "ring_reduce_scatter",
        tensor,
        group,
        async_op,
        lambda ring: ring.reduce_scatter(op),
        reduce_op=op,
    )


def ring_all_gather(tensor: torch.Tensor, group=None, async_op: bool = False, prepare=None):
    """Fill every chunk of ``tensor`` from its owner: group rank r contributes chunk r of
    ``even_chunks(numel, N)``. Returns ``tensor``. ``prepare`` (no arguments) runs on the
    thread that runs the op, just before it: it may put this rank's chunk in place."""
    return _run(
        "ring_all_gather",
        tensor,
        group,
        async_op,
        lambda ring: (ring.all_gather(), tensor)[1],
        prepare=prepare,
    )


def ring_all_reduce(
    tensor: torch.Tensor, op="sum", group=None, async_op: bool = False, prepare=None
):
    """All-reduce ``tensor`` in place as reduce-scatter then all-gather. Returns ``tensor``.
    ``prepare`` as for ``ring_all_gather``: it may fill ``tensor``."""
    op = parse_reduce_op(op)
    check_avg_dtype(op, tensor, "tensor")

    def both(ring: _Ring) -> torch.Tensor:
        ring.reduce_scatter(op)
        ring.all_gather()
        return tensor

    return _run("ring_all_reduce", tensor, group, async_op, both, reduce_op=op, prepare=prepare)
