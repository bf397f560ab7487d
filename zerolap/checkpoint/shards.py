"""Optimizer shards as pieces of named parameters, so any layout can read any other's.

A rank's shard is a list of *runs* (its optimizer's flat ranges, see ``zero.layout``). Each run
is saved with its *segments*: which parameter, which element range of it, and where that range
sits in the run. Loading at another world size or stage walks the new runs, and for every
segment copies the overlapping element ranges of the saved segments of the same parameter.
Nothing about the old world size or bucket layout is needed beyond those names and ranges.

The runs' fp32 values are also the checkpoint's copy of the trainable parameters (``SavedParams``):
for stages 1-3 every element is owned by exactly one rank, for stage 0 rank 0 saves them all, so
their union is every parameter, exact even when the model trained in 16 bits. Under stage 3,
where no rank holds whole parameters, owned elements that no optimizer group holds (a client
that passed ``model_parameters`` a subset) are saved as runs of group -1 with no state.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from dataclasses import dataclass

import torch

from zerolap.checkpoint.files import CheckpointError

__all__ = [
    "SavedParams",
    "SegmentIndex",
    "collect_runs",
    "collect_unoptimized",
    "gather_state",
    "param_segments",
    "restore_rng",
    "rng_state",
    "segments_of",
]


@dataclass(frozen=True)
class Segment:
    name: str
    param_start: int  # element range inside the parameter
    param_end: int
    run_offset: int  # where param_start sits inside the run

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


def segments_of(
    layout, names: list[str], start: int, end: int, splits: dict | None = None
) -> list[Segment]:
    """The parameter ranges covering flat ``[start, end)`` (padding has none), in whole-
    parameter elements: a tensor-parallel piece (``splits[name]``, a ``Split``) is mapped to
    the ranges of the whole parameter it holds, so any tensor-parallel size can read it."""
    out = []
    for slot, lo, hi in layout.pieces(start, end):
        name, base = names[slot], layout.slots[slot].offset
        split = splits.get(name) if splits else None
        if split is None:
            out.append(Segment(name, lo - base, hi - base, lo - start))
            continue
        for a, b, offset in split.full_ranges(lo - base, hi - base):
            out.append(Segment(name, a, b, lo - start + offset))
    return out


def param_segments(name: str, numel: int, split) -> list[Segment]:
    """All of one parameter (a whole one, or a tensor-parallel piece) as segments."""
    if split is None:
        return [Segment(name, 0, numel, 0)]
    return [Segment(name, a, b, offset) for a, b, offset in split.full_ranges(0, numel)]


def collect_runs(
    optimizer, layout, names: list[str], splits: dict | None = None, only: set[int] | None = None
) -> list[dict]:
    """This rank's runs (or those ``only`` names): segments, fp32 values and optimizer state,
    as standalone tensors (a saved view would drag its whole flat buffer into the file;
    swapped runs are read in)."""
    runs: dict[int, dict] = {}
    for i, values, state in optimizer.visit_runs(only=only):
        run = optimizer.runs[i]
        runs[i] = {
            "group": run.group,
            "segments": segments_of(layout, names, run.start, run.end, splits),
            "values": values.detach().float().clone(),
            "state": {
                k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                for k, v in state.items()
            },
        }
    return [runs[i] for i in sorted(runs)]


def collect_unoptimized(
    layout, names: list[str], runs, ranges: list[tuple[int, int]], shard_slice, splits=None
) -> list[dict]:
    """Stage 3: this rank's elements (flat ``ranges``, read by ``shard_slice(position,
    numel)``) of parameters that no optimizer run holds, as runs of group -1 with no state. A
    piece of a parameter is wholly covered by runs or wholly outside every run
    (``FlatLayout.runs`` never splits one; sub-groups may cut it into several runs)."""
    out = []
    for start, end in ranges:
        for slot, lo, hi in layout.pieces(start, end):
            if any(run.start < hi and lo < run.end for run in runs):
                continue
            pos = layout.shard_position(layout.slots[slot].bucket, lo)
            out.append(
                {
                    "group": -1,
                    "segments": segments_of(layout, names, lo, hi, splits),
                    "values": shard_slice(pos, hi - lo).detach().float().clone(),
                    "state": {},
                }
            )
    return out


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


class SavedParams:
    """Elements of each saved parameter, in fp32: from the saved pieces when they hold the whole
    parameter; otherwise from the whole tensor in the module states (stages 0-2, and there
    every parameter outside the optimizer, frozen ones included)."""

    def __init__(self, saved: dict, index: SegmentIndex) -> None:
        self.index = index
        aliases = saved["aliases"]
        self.shapes = {k: tuple(t.shape) for k, t in saved["module"].items() if k not in aliases}
        self.shapes.update((n, tuple(s)) for n, s in saved["param_shapes"].items())
        self.whole: dict[str, torch.Tensor] = {}
        for key, tensor in saved["module"].items():
            name = aliases.get(key, key)
            if tuple(tensor.shape) == self.shapes[name]:  # stage 3 saves empty placeholders
                self.whole.setdefault(name, tensor)

    def numel(self, name: str) -> int:
        return math.prod(self.shapes[name])

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds ``name`` (one saved without frozen parameters lacks
        them)."""
        return name in self.shapes

    def fill(self, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Copy elements ``[lo, hi)`` of ``name`` into the 1-D ``out``, cast to its dtype."""
        numel = self.numel(name)
        if self.index.covered(name) >= numel:

            def put(run, src, dst, count):
                out[dst : dst + count] = run["values"][src : src + count]

            self.index.fill(name, lo, hi, put)
        elif name in self.whole:
            out.copy_(self.whole[name].reshape(-1)[lo:hi])
        else:
            raise CheckpointError(
                f"the optimizer shards hold {self.index.covered(name)} of the {numel} "
                f"elements of {name} and the module states do not hold it whole: a shard is "
                "missing or from another run"
            )

    def whole_fp32(self, name: str) -> torch.Tensor:
        full = torch.empty(self.numel(name), dtype=torch.float32)
        self.fill(name, 0, full.numel(), full)
        return full.view(self.shapes[name])


def _per_element(value, numel: int) -> bool:
    """Optimizer state that has one entry per element (Adam's moments), not per run (step)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def gather_state(numel: int, dtype: torch.dtype, segments: list[Segment], index) -> dict:
    """The optimizer state of ``numel`` elements whose values are ``dtype`` (a run, or one
    whole parameter), gathered from the saved pieces of the same parameter elements
    (``segments``, found in the ``SegmentIndex``): per-element tensors piece by piece,
    per-run entries (Adam's step) from one."""
    state: dict = {}
    source = None
    for segment in segments:

        def put(saved, src, dst, count, base=segment.run_offset):
            for key, tensor in saved["state"].items():
                if _per_element(tensor, saved["values"].numel()):
                    # In the dtype of the values it goes with, as torch's load_state_dict casts:
                    # fp32 moments saved beside an fp32 master load beside bf16 masters.
                    kind = dtype if tensor.is_floating_point() else tensor.dtype
                    target = state.setdefault(key, torch.zeros(numel, dtype=kind))
                    target[base + dst : base + dst + count] = tensor[src : src + count]

        source = index.fill(segment.name, segment.param_start, segment.param_end, put) or source
    if source is not None:
        for key, value in source["state"].items():
            if key not in state:
                state[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return state


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
