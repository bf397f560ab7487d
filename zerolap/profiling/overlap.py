"""How much communication a step hid behind computation.

For one rank and one step, from its compute spans and its communication spans:

    T_compute = length of the union of compute spans
    T_comm    = length of the union of communication spans
    exposed   = communication time during which no compute ran = T_comm - |compute ∩ comm|
    eta       = hidden / T_comm = 1 - exposed / T_comm

and the step's wall time against the two bounds: perfect overlap takes max(T_compute, T_comm),
none takes T_compute + T_comm.

Per kind of collective (the comms logger's op name, e.g. tensor parallelism's forward and
backward all-reduces), ``exposure`` reads the same quantities off the records themselves:
T_comm is the union of the collectives' launch-to-completion spans, and the exposed part is the
union of the spans during which the caller sat in them instead of computing (the launching call
and ``wait()``), within those spans. This is the host's view: on CUDA, where ``wait()`` only
orders streams, it does not see the device waiting, and on a host whose cores the transfers
share, hidden communication still slows the compute down; the step time against the same step
without the communication is the figure that settles both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from zerolap.comm.logger import CommRecord
from zerolap.profiling.intervals import Interval, covered, intersection_length

__all__ = ["Exposure", "OverlapStats", "exposure", "overlap_stats", "total_exposure"]


@dataclass(frozen=True)
class OverlapStats:
    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float

    @property
    def hidden_comm_s(self) -> float:
        return self.comm_s - self.exposed_comm_s

    @property
    def eta(self) -> float:
        """Overlap efficiency: the share of communication hidden behind compute (1 if none)."""
        return 1.0 if self.comm_s == 0 else self.hidden_comm_s / self.comm_s

    @property
    def ideal_s(self) -> float:
        return max(self.compute_s, self.comm_s)

    @property
    def serial_s(self) -> float:
        return self.compute_s + self.comm_s

    def as_dict(self) -> dict:
        return {
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_comm_s,
            "hidden_comm_s": self.hidden_comm_s,
            "eta": self.eta,
            "ideal_s": self.ideal_s,
            "serial_s": self.serial_s,
        }


def overlap_stats(compute: list[Interval], comm: list[Interval], *, step: Interval) -> OverlapStats:
    """Overlap figures of one step; spans are clipped to ``step``."""
    lo, hi = step

    def clip(spans: list[Interval]) -> list[Interval]:
        return [(max(s, lo), min(e, hi)) for s, e in spans if e > lo and s < hi]

    compute, comm = clip(compute), clip(comm)
    comm_s = covered(comm)
    return OverlapStats(
        step_s=hi - lo,
        compute_s=covered(compute),
        comm_s=comm_s,
        exposed_comm_s=comm_s - intersection_length(compute, comm),
    )


@dataclass(frozen=True)
class Exposure:
    """One kind of collective over some steps: how many, their bytes, and how much was hidden."""

    count: int
    message_bytes: int
    comm_s: float
    exposed_s: float

    @property
    def eta(self) -> float:
        return 1.0 if self.comm_s == 0 else 1 - min(self.exposed_s, self.comm_s) / self.comm_s

    def as_dict(self) -> dict:
        return {**asdict(self), "eta": self.eta}


def _exposure(records: list[CommRecord], window: Interval | None = None) -> Exposure:
    if window is not None:
        lo, hi = window
        records = [r for r in records if r.end > lo and r.start < hi]
    spans = [(r.start, r.end) for r in records]
    blocked = [span for r in records for span in r.blocked()]
    if window is not None:
        spans, blocked = (
            [(max(s, lo), min(e, hi)) for s, e in group if e > lo and s < hi]
            for group in (spans, blocked)
        )
    return Exposure(
        count=len(records),
        message_bytes=sum(r.message_bytes for r in records),
        comm_s=covered(spans),
        exposed_s=intersection_length(blocked, spans),
    )


def exposure(records: Iterable[CommRecord], ops: Iterable[str]) -> dict[str, Exposure]:
    """``Exposure`` of each op name in ``ops`` among ``records`` (completed ones)."""
    records = [r for r in records if r.end is not None]
    return {op: _exposure([r for r in records if r.name == op]) for op in ops}


def total_exposure(records: Iterable[CommRecord], window: Interval | None = None) -> Exposure:
    """Every completed record as one kind, within ``window`` if given (records that overlap it,
    their spans clipped to it): over a whole step, its gradient reductions and parameter gathers
    together against the time the caller sat in them. Clipping to a step counts a gather that
    the previous step started and this one's forward waited for where it ran and where it was
    waited. A record not completed yet (in flight, or a CUDA record its events have not
    resolved: ``CommRecord.resolve``) is left out; count it once it has completed."""
    return _exposure([r for r in records if r.end is not None], window)
