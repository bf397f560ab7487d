"""A gradient bucket: a run of parameters whose gradients are reduced by one collective.

State machine, one transition per event::

    EMPTY --first grad--> FILLING --last grad--> READY --its turn--> REDUCING --wait--> REDUCED
                                                  ^                                  |
                                                  +---- FILLING <--late grad-------------+

``reset()`` returns a bucket to EMPTY at the start of every backward.

READY exists because buckets are launched strictly in index order: every rank then issues the
same collectives in the same order even when gradients arrive in a different order (unused
parameters, data-dependent graphs), which is what keeps a ring from deadlocking.
"""

from __future__ import annotations

import enum

import torch

from zerolap.zero.layout import BucketLayout

__all__ = ["Bucket", "BucketState", "IllegalTransition"]


class BucketState(enum.Enum):
    EMPTY = "empty"
    FILLING = "filling"
    READY = "ready"
    REDUCING = "reducing"
    REDUCED = "reduced"


class IllegalTransition(RuntimeError):
    pass


_ALLOWED = {
    BucketState.EMPTY: {BucketState.FILLING, BucketState.READY},
    BucketState.FILLING: {BucketState.READY},
    BucketState.READY: {BucketState.REDUCING},
    BucketState.REDUCING: {BucketState.REDUCED},
    # A gradient that arrives after its bucket was reduced (the same parameter reached twice
    # in one backward) refills the bucket for a second round at the end of backward.
    BucketState.REDUCED: {BucketState.FILLING},
}


class Bucket:
    """One bucket's live state; its place in the flat buffer is ``layout``."""

    def __init__(self, layout: BucketLayout) -> None:
        self.layout = layout
        self.state = BucketState.EMPTY
        self.pending = set(layout.slots)  # slot indices whose gradient has not arrived
        self.buffer: torch.Tensor | None = None  # what the collective reduces
        self.handle = None  # the in-flight collective's Handle
        self.finalize = None  # scales and delivers the result once the handle is waited
        # Gradients taken but not yet written, as (slot, gradient) per part of the bucket
        # (``BucketLayout.parts``: a coalesced bucket's members, stage 3's units): a batched
        # reducer writes a part's first round all at once when it completes (``GradReducer``'s
        # ``batched``), and ``parts_pending`` says which of each part's slots are still due.
        self.held: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self.parts_pending = [set(part.slots) for part in layout.parts()]
        # True once a round has delivered reduced values for this bucket in the current
        # accumulation cycle: later gradients must be reduced on their own and added.
        self.delivered = False

    @property
    def index(self) -> int:
        return self.layout.index

    def move(self, new: BucketState, why: str = "") -> None:
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(
                f"bucket {self.index}: {self.state.value} -> {new.value} is not allowed {why}"
            )
        self.state = new

    def mark_ready(self, slot: int) -> bool:
        """Record ``slot``'s gradient; True when it completes the bucket."""
        self.pending.discard(slot)
        if self.state == BucketState.EMPTY:
            self.move(BucketState.FILLING)
        if not self.pending and self.state == BucketState.FILLING:
            self.move(BucketState.READY)
            return True
        return False

    def refill_late(self, slot: int) -> None:
        """A gradient for ``slot`` arrived after this bucket's round: open a second round."""
        self.move(BucketState.FILLING, f"(late gradient for slot {slot})")
        self.pending = set()

    def reset(self) -> None:
        """Back to EMPTY for the next backward (not a transition: any state may be abandoned
        when a backward does not reduce, e.g. under no_sync)."""
        self.state = BucketState.EMPTY
        self.pending = set(self.layout.slots)
        self.buffer = None
        self.handle = None
        self.finalize = None
        self.held = {}
        self.parts_pending = [set(part.slots) for part in self.layout.parts()]
