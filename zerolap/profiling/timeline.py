"""Spans on lanes per rank (compute, communication, and when there are any tensor parallelism's
all-reduces and a pipeline's point-to-point messages), and the two ways people look at them: a
Chrome/Perfetto trace
and a PNG in the style of ``|---compute---| |--All-Reduce--|`` diagrams.

Times are ``time.perf_counter()`` seconds. On one host every process reads the same monotonic
clock, so ranks line up; each trace is shifted so its earliest span starts at 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Span", "write_chrome_trace", "write_timeline_png"]

COMPUTE, COMM, TP_COMM, P2P_COMM = "compute", "comm", "tp comm", "p2p"
LANES = (COMPUTE, COMM, TP_COMM, P2P_COMM)
_OPTIONAL = (TP_COMM, P2P_COMM)  # drawn only when used

_COLOURS = {
    "tp_forward": "#17BECF",
    "tp_backward": "#BCBD22",
    "forward": "#4C72B0",
    "backward": "#55A868",
    "optimizer": "#8172B3",
    "reduce_scatter": "#C44E52",
    "all_reduce": "#DD8452",
    "all_gather": "#937860",
    "broadcast": "#DA8BC3",
    "isend": "#8C564B",
    "irecv": "#E377C2",
}


@dataclass(frozen=True)
class Span:
    rank: int
    lane: str  # one of LANES
    name: str  # "forward", "backward:blocks.3", "ring_reduce_scatter", ...
    start: float
    end: float
    step: int = -1

    @property
    def kind(self) -> str:
        """The colour family: the phase for compute spans, the collective for comm spans."""
        base = self.name.split(":")[0].removeprefix("ring_")
        for kind in _COLOURS:
            if base.startswith(kind):
                return kind
        return base


def _origin(spans: list[Span]) -> float:
    return min((s.start for s in spans), default=0.0)


def write_chrome_trace(spans: Iterable[Span], path: str | Path) -> Path:
    """A JSON trace for chrome://tracing or ui.perfetto.dev: one process per rank, one thread
    per lane, one complete ("X") event per span."""
    spans = list(spans)
    origin = _origin(spans)
    events = []
    for rank in sorted({s.rank for s in spans}):
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": rank,
                "tid": 0,
                "args": {"name": f"rank {rank}"},
            }
        )
        for tid, lane in enumerate(LANES):
            events.append(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}}
            )
    for span in spans:
        events.append(
            {
                "ph": "X",
                "name": span.name,
                "cat": span.kind,
                "pid": span.rank,
                "tid": LANES.index(span.lane),
                "ts": (span.start - origin) * 1e6,
                "dur": max(span.end - span.start, 0.0) * 1e6,
                "args": {"step": span.step},
            }
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def write_timeline_png(spans: Iterable[Span], path: str | Path, *, title: str = "") -> Path:
    """Compute and comm lanes (and the TP and p2p lanes when used) for every rank, time in
    milliseconds on the x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = list(spans)
    origin = _origin(spans)
    ranks = sorted({s.rank for s in spans})
    used = {s.lane for s in spans}
    rows = [(r, lane) for r in ranks for lane in LANES if lane in used or lane not in _OPTIONAL]
    fig, ax = plt.subplots(figsize=(14, 0.9 * len(rows) + 1.4))
    for y, (rank, lane) in enumerate(rows):
        lane_spans = [s for s in spans if s.rank == rank and s.lane == lane]
        # Coarse phases first, per-block detail drawn over them, slimmer.
        for span in sorted(lane_spans, key=lambda s: ":" in s.name):
            detail = ":" in span.name
            height = 0.45 if detail else 0.8
            ax.broken_barh(
                [((span.start - origin) * 1e3, (span.end - span.start) * 1e3)],
                (len(rows) - 1 - y - height / 2, height),
                facecolors=_COLOURS.get(span.kind, "#999999"),
                edgecolor="white" if detail else "none",
                linewidth=0.3,
                alpha=0.95,
            )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} {lane}" for r, lane in reversed(rows)])
    ax.set_xlabel("time (ms)")
    ax.set_title(title or "zerolap timeline")
    order = list(_COLOURS)
    kinds = sorted({s.kind for s in spans}, key=lambda k: order.index(k) if k in order else 99)
    ax.legend(
        handles=[Patch(color=_COLOURS.get(k, "#999999"), label=k) for k in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18),
        ncol=min(len(kinds), 7),
        frameon=False,
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def spans_to_dicts(spans: Iterable[Span]) -> list[dict]:
    return [asdict(s) for s in spans]
