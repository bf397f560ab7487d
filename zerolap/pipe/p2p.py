"""How pipeline stages talk: activations to the next stage, their gradients back, point to point.

Every message is a plain ``isend`` / ``irecv`` between two neighbours (no ``batch_isend_irecv``,
which is fragile on gloo), with a tag naming its direction, receiving chunk, micro-batch and
tensor, so a receive matches exactly one send whatever else is in flight (gloo matches by tag;
NCCL, which runs a pair's operations in posting order, is not used for pipelines). Each
direction carries its messages in micro-batch order (``pipe.schedule``), so a receive can be
posted early, before the compute that precedes it, and the transfer runs on the backend's
threads meanwhile.

A stage's outputs may be a tensor or a tuple of tensors, of any dtype; gradients go back only
for the floating ones that require grad. Their metadata (count, dtypes, shapes, requires_grad)
crosses once per mode (training, evaluation), before the first activations; later messages
must match it (a named error on the sending stage otherwise) unless the module has
``dynamic_shape``, when it crosses every time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

import zerolap.comm as dist
from zerolap.comm.handle import CommError, Handle

__all__ = ["Direction", "PipeError", "PipelineShapeError", "StageLink", "TensorMeta"]

# Tags of pipeline traffic: far from the ring's (comm.ring.RING_TAG) and from tag 0, which user
# sends default to. A tag names the direction, the receiving chunk (its global index: the stage
# without virtual stages), the micro-batch modulo 256 (never that many apart in flight) and the
# tensor.
PIPE_TAG = 0x5B000000
MAX_CHUNKS = 64
_MAX_TENSORS = 256
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


class Direction(Enum):
    ACTIVATIONS = 0
    GRADIENTS = 1
    METADATA = 2


def _tag(direction: Direction, channel: int, micro_batch: int, index: int) -> int:
    return PIPE_TAG + (direction.value << 22) + (channel << 16) + ((micro_batch % 256) << 8) + index


class PipeError(CommError):
    """A pipeline message that failed (a peer died), naming the stage, the micro-batch and
    the peer."""


class PipelineShapeError(ValueError):
    """A stage's outputs changed shape between micro-batches without ``dynamic_shape``."""


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def sends_grad(self) -> bool:
        """Whether a gradient for this tensor comes back."""
        return self.requires_grad and self.dtype.is_floating_point


def describe(tensors: tuple[torch.Tensor, ...]) -> tuple[TensorMeta, ...]:
    return tuple(TensorMeta(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors)


def _encode(metas: tuple[TensorMeta, ...], bare: bool) -> torch.Tensor:
    words = [len(metas), int(bare)]
    for meta in metas:
        words += [_DTYPES.index(meta.dtype), int(meta.requires_grad), len(meta.shape), *meta.shape]
    return torch.tensor(words, dtype=torch.int64)


def _decode(words: list[int]) -> tuple[tuple[TensorMeta, ...], bool]:
    metas, at = [], 2
    for _ in range(words[0]):
        dtype, grad, ndim = words[at : at + 3]
        shape = tuple(words[at + 3 : at + 3 + ndim])
        metas.append(TensorMeta(shape, _DTYPES[dtype], bool(grad)))
        at += 3 + ndim
    return tuple(metas), bool(words[1])


class Pending:
    """Receives posted for one message; ``wait()`` gives its tensors."""

    def __init__(
        self,
        tensors: list[torch.Tensor],
        handles: list[Handle],
        fail: Callable,
        direction: Direction,
        micro_batch: int,
        channel: int,
        wants_grad: list[bool] | None = None,
        bare: bool = False,
    ) -> None:
        self.direction, self.micro_batch, self.channel = direction, micro_batch, channel
        self.tensors = tensors
        self.bare = bare  # activations the sender's layer returned as one tensor, not a tuple
        self.handles = handles
        self._fail = fail
        self._wants_grad = wants_grad or []  # received activations that will take a gradient

    def wait(self):
        """The received tensors: one tensor, or a tuple, as the sender's layer returned them."""
        for handle in self.handles:
            try:
                handle.wait()
            except CommError as err:
                raise self._fail(err) from err
        for tensor, wants in zip(self.tensors, self._wants_grad, strict=False):
            if wants:
                tensor.requires_grad_()
        return self.tensors[0] if self.bare else tuple(self.tensors)


class StageLink:
    """This stage's traffic with one neighbouring stage (``peer_rank``): what it sends there and
    what it receives from there. Sends are kept until complete (their tensors with them) and
    reaped as later steps run; ``drain()`` waits for the last of them."""

    def __init__(self, *, stage: int, peer_stage: int, peer_rank: int, dynamic_shape: bool):
        self.stage, self.peer_stage, self.peer_rank = stage, peer_stage, peer_rank
        self.dynamic_shape = dynamic_shape
        # Per (mode, receiving chunk) (mode True: training): what the peer expects from us, what
        # we expect from it: the tensors, and whether they are one tensor rather than a tuple.
        self.sent_meta: dict[tuple[bool, int], tuple[tuple[TensorMeta, ...], bool]] = {}
        self.received_meta: dict[tuple[bool, int], tuple[tuple[TensorMeta, ...], bool]] = {}
        self._sends: list[tuple[Handle, tuple[torch.Tensor, ...]]] = []
        self.wait_s = 0.0  # time blocked in receives (a measure of exposed p2p)
        # This batch's messages, for measuring exposed p2p across ranks (one host's monotonic
        # clock): ("send", direction, micro-batch, issued, issued, bytes, receiving chunk) as
        # each is issued and ("wait", ...) with when it began and ended as each receive is
        # awaited.
        self.trace: list[tuple[str, str, int, float, float, int, int]] = []

    # -- sending ------------------------------------------------------------------------------

    def send_activations(self, outputs, micro_batch: int, train: bool, channel: int) -> None:
        """``outputs``: a tensor or a tuple of tensors, received as the same."""
        bare = isinstance(outputs, torch.Tensor)
        tensors = (outputs,) if bare else outputs
        metas = (describe(tensors), bare)
        known = self.sent_meta.get((train, channel))
        if known is None or self.dynamic_shape:
            self._send_meta(*metas, micro_batch, channel)
            self.sent_meta[(train, channel)] = metas
        elif metas != known:
            raise PipelineShapeError(
                f"pipeline stage {self.stage}: the outputs of micro-batch {micro_batch} are "
                f"{_show(*metas)} but were {_show(*known)} before; pass dynamic_shape=True to "
                "PipelineModule if they may change"
            )
        self._send(Direction.ACTIVATIONS, tensors, micro_batch, channel)

    def send_grads(self, grads: tuple[torch.Tensor, ...], micro_batch: int, channel: int) -> None:
        self._send(Direction.GRADIENTS, grads, micro_batch, channel)

    def _send_meta(
        self, metas: tuple[TensorMeta, ...], bare: bool, micro_batch: int, channel: int
    ) -> None:
        if len(metas) > _MAX_TENSORS:
            raise PipeError(
                f"pipeline stage {self.stage} sends {len(metas)} tensors; at most {_MAX_TENSORS}"
            )
        words = _encode(metas, bare)
        length = torch.tensor([words.numel()], dtype=torch.int64)
        self._send(Direction.METADATA, (length, words), micro_batch, channel)

    def _send(self, direction: Direction, tensors, micro_batch: int, channel: int) -> None:
        issued, nbytes = time.perf_counter(), 0
        for index, tensor in enumerate(tensors):
            payload = tensor.detach().contiguous()
            tag = _tag(direction, channel, micro_batch, index)
            handle = dist.isend(payload, self.peer_rank, tag=tag)
            self._sends.append((handle, payload))
            nbytes += payload.numel() * payload.element_size()
        self.trace.append(("send", direction.name, micro_batch, issued, issued, nbytes, channel))

    def forget(self, *, train: bool) -> None:
        """Forget one mode's metadata: the next message of that mode carries it again (both
        ends must forget together)."""
        for known in (self.sent_meta, self.received_meta):
            for key in [k for k in known if k[0] == train]:
                del known[key]

    def reap(self) -> None:
        """Finish completed sends (their tensors may then be freed)."""
        completed = [handle.is_completed() for handle, _ in self._sends]
        done = [send for send, c in zip(self._sends, completed, strict=True) if c]
        self._sends = [send for send, c in zip(self._sends, completed, strict=True) if not c]
        self._finish(done)

    def drain(self) -> None:
        """Wait for every send still in flight."""
        sends, self._sends = self._sends, []
        self._finish(sends)

    def _finish(self, sends) -> None:
        for handle, _ in sends:
            try:
                handle.wait()
            except CommError as err:
                raise self._fault(f"sending to stage {self.peer_stage}", err) from err

    # -- receiving ----------------------------------------------------------------------------

    def post_activations(self, micro_batch: int, train: bool, channel: int) -> Pending:
        """Post the receives of ``micro_batch``'s activations for chunk ``channel`` (the
        metadata first, blocking, when it is still unknown)."""
        key = (train, channel)
        if key not in self.received_meta or self.dynamic_shape:
            self.received_meta[key] = self._receive_meta(micro_batch, channel)
        metas, bare = self.received_meta[key]
        tensors = [torch.empty(m.shape, dtype=m.dtype) for m in metas]
        wants = [train and m.sends_grad for m in metas]
        return self._post(
            Direction.ACTIVATIONS,
            tensors,
            micro_batch,
            channel,
            "activations",
            wants_grad=wants,
            bare=bare,
        )

    def post_grads(
        self, micro_batch: int, outputs: tuple[torch.Tensor, ...], channel: int
    ) -> Pending:
        """Post the receives of the gradients of ``outputs``, ``micro_batch``'s outputs of
        chunk ``channel`` sent to this peer in training."""
        tensors = [torch.empty_like(t) for t in outputs if t.requires_grad]
        return self._post(Direction.GRADIENTS, tensors, micro_batch, channel, "gradients")

    def wait(self, pending: Pending):
        start = time.perf_counter()
        try:
            return pending.wait()
        finally:
            end = time.perf_counter()
            self.wait_s += end - start
            nbytes = sum(t.numel() * t.element_size() for t in pending.tensors)
            self.trace.append(
                (
                    "wait",
                    pending.direction.name,
                    pending.micro_batch,
                    start,
                    end,
                    nbytes,
                    pending.channel,
                )
            )

    def _receive_meta(self, micro_batch: int, channel: int) -> tuple[tuple[TensorMeta, ...], bool]:
        length = torch.empty(1, dtype=torch.int64)
        self._post(Direction.METADATA, [length], micro_batch, channel, "metadata").wait()
        words = torch.empty(int(length.item()), dtype=torch.int64)
        self._post(Direction.METADATA, [words], micro_batch, channel, "metadata", 1).wait()
        return _decode(words.tolist())

    def _post(
        self,
        direction,
        tensors,
        micro_batch: int,
        channel: int,
        what: str,
        index: int = 0,
        wants_grad: list[bool] | None = None,
        bare: bool = False,
    ) -> Pending:
        handles = [
            dist.irecv(t, self.peer_rank, tag=_tag(direction, channel, micro_batch, index + i))
            for i, t in enumerate(tensors)
        ]
        doing = f"waiting for the {what} of micro-batch {micro_batch} from stage {self.peer_stage}"
        fail = lambda err: self._fault(doing, err)  # noqa: E731
        return Pending(tensors, handles, fail, direction, micro_batch, channel, wants_grad, bare)

    def _fault(self, doing: str, err: Exception) -> PipeError:
        return PipeError(
            f"pipeline stage {self.stage} (rank {dist.get_rank()}) {doing} "
            f"(rank {self.peer_rank}): {err}"
        )


def _show(metas: tuple[TensorMeta, ...], bare: bool = False) -> str:
    shown = ", ".join(f"{tuple(m.shape)} {str(m.dtype).removeprefix('torch.')}" for m in metas)
    return shown if bare else f"({shown})"
