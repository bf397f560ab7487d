"""The order in which stage-3 units are fetched in one step, recorded to prefetch the next.

A step is everything from one ``engine.forward`` to the next: the forward's fetches, then the
backward's. The first step is recorded; later steps are compared with the record fetch by fetch.
While they agree the fetcher knows what comes next and gathers it ahead; at the first
disagreement (a branch taken this step only, a different graph in eval) the step is *off trace*:
the rest of it fetches on demand, and the order it actually took becomes the record for the next
step. A step that stops early (a forward without backward) is a prefix, not a disagreement; a
step that goes on past a record of a forward-only step (an evaluation through the engine) is an
extension, and becomes the record.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator

__all__ = ["FetchTrace"]


class FetchTrace:
    def __init__(self, numels: list[int]) -> None:
        self.numels = numels  # elements of each unit
        self.recorded: list[int] | None = None
        self.current: list[int] = []
        self.on_trace = False
        self.misses = 0  # steps that left the record
        self._positions: dict[int, list[int]] = {}
        self._prefix: list[int] = [0]
        self._discard = False  # whether this step's order is not the next one's (``restart``)
        self._backward = False  # whether this step's backward has ended
        self._recorded_backward = False  # whether the record's step had one

    def begin_step(self) -> None:
        """Close the step that ran (its order becomes the record if it left the old one)."""
        if self.current and not self._discard and (self.recorded is None or not self.on_trace):
            self._adopt(self.current)
            self._recorded_backward = self._backward
        self._discard = self._backward = False
        self.current = []
        self.on_trace = self.recorded is not None

    def _adopt(self, order: list[int]) -> None:
        self.recorded = list(order)
        self._positions = {}
        for pos, unit in enumerate(order):
            self._positions.setdefault(unit, []).append(pos)
        self._prefix = [0, *itertools.accumulate(self.numels[u] for u in order)]

    def end_backward(self) -> None:
        """A training step ends with its backward. If it ran on trace but stopped short of the
        record, the record's tail (forwards that once followed a backward, such as a generation
        loop) is not part of training: drop it, or every later step would prefetch it."""
        self._backward = True
        if self.on_trace and len(self.current) < len(self.recorded):
            self._adopt(self.current)
            self._recorded_backward = True

    def restart(self) -> None:
        """A module's fetches changed during this step (it took over a unit it read or was
        handed): the next step's order is not this one's, so the record goes and the next step
        records afresh, neither comparing itself with this one nor adopting it."""
        self.invalidate()
        self._discard = True

    def invalidate(self) -> None:
        """Forget the record: the next step records afresh (after hooks were taken off and put
        back, the order may differ)."""
        self.recorded, self.on_trace = None, False
        self._positions, self._prefix = {}, [0]
        self._recorded_backward = False

    # DeepSpeed's coordinator names, as TRL calls them.
    def is_invalid_trace(self) -> bool:
        return self.recorded is None

    _invalidate_trace = invalidate

    @property
    def position(self) -> int:
        """Index of the latest fetch in this step (-1 before the first)."""
        return len(self.current) - 1

    def observe(self, unit: int) -> bool:
        """Record a fetch of ``unit``; False once the step is off trace (returns the
        disagreement as it happens: the caller warns)."""
        pos = len(self.current)
        self.current.append(unit)
        if self.on_trace and (pos >= len(self.recorded) or self.recorded[pos] != unit):
            self.on_trace = False
            if pos >= len(self.recorded) and not self._recorded_backward:
                # The record is a forward-only step (an evaluation through the engine, before
                # the first training step or after a restart): a step that goes on past it,
                # its backward included, departs from nothing and becomes the record.
                return True
            self.misses += 1
            return False
        return True

    def upcoming(self) -> Iterator[int]:
        """Units the record says come after the latest fetch (none off trace), lazily: the
        prefetch usually stops after a few."""
        if not self.on_trace:
            return iter(())
        return itertools.islice(self.recorded, len(self.current), None)

    def next_step(self) -> Iterator[int]:
        """The units the next step is expected to fetch, in order: the record, or the order
        this step took if it left the record (or is the first), which becomes the record when
        the next step begins."""
        order = self.recorded if self.recorded is not None and self.on_trace else self.current
        return iter(list(order))

    def reuse_distance(self, unit: int) -> int | None:
        """Elements fetched between now and ``unit``'s next use in this step, per the record;
        None when it is not used again (or the step is off trace)."""
        if not self.on_trace:
            return None
        positions = self._positions.get(unit, [])
        after = bisect.bisect_right(positions, self.position)
        if after == len(positions):
            return None
        return self._prefix[positions[after]] - self._prefix[self.position + 1]
