"""Optimizer shards as pieces of named parameters, so any layout can read any other's.

A rank's shard is a list of *runs* (its optimizer's flat ranges, see ``zero.layout``). Each run
is saved with its *segments*: which parameter, which element range of it, and where that range
sits in the run. Loading at another world size or stage walks the new runs, and for every
segment copies the overlapping element ranges of the saved segments of the same parameter.
Nothing about the old world size or bucket layout is needed beyond those names and ranges.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

import torch

__all__ = ["SegmentIndex", "collect_runs", "restore_rng", "rng_state", "segments_of"]


@dataclass(frozen=True)
class Segment:
    name: str
    param_start: int  # element range inside the parameter
    param_end: int
    run_offset: int  # where param_start sits inside the run


def segments_of(layout, names: list[str], start: int, end: int) -> list[Segment]:
    """The parameter ranges covering flat ``[start, end)`` (padding has none)."""
    return [
        Segment(
            names[slot], lo - layout.slots[slot].offset, hi - layout.slots[slot].offset, lo - start
        )
        for slot, lo, hi in layout.pieces(start, end)
    ]


def collect_runs(optimizer, layout, names: list[str]) -> list[dict]:
    """This rank's runs: segments, fp32 values and optimizer state, as standalone tensors
    (a saved view would drag its whole flat buffer into the file)."""
    runs = []
    for run, view in zip(optimizer.runs, optimizer.views, strict=True):
        state = optimizer.inner.state.get(view, {})
        runs.append(
            {
                "group": run.group,
                "segments": segments_of(layout, names, run.start, run.end),
                "values": view.detach().float().clone(),
                "state": {
                    k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                    for k, v in state.items()
                },
            }
        )
    return runs


class SegmentIndex:
    """Every saved run's segments, by parameter name."""

    def __init__(self, shards: list[dict]) -> None:
        self.by_name: dict[str, list[tuple[Segment, dict]]] = defaultdict(list)
        for shard in shards:
            for run in shard["runs"]:
                for segment in run["segments"]:
                    self.by_name[segment.name].append((segment, run))

    def fill(self, name: str, lo: int, hi: int, put) -> dict | None:
        """Call ``put(run, src_offset, dst_offset, count)`` for each saved piece overlapping
        elements ``[lo, hi)`` of ``name``; returns one of the saved runs it drew from."""
        source = None
        for segment, run in self.by_name.get(name, []):
            a, b = max(lo, segment.param_start), min(hi, segment.param_end)
            if a < b:
                put(run, segment.run_offset + a - segment.param_start, a - lo, b - a)
                source = run
        return source

    def covered(self, name: str) -> int:
        return sum(s.param_end - s.param_start for s, _ in self.by_name.get(name, []))


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
