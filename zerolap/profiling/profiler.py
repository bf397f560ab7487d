"""``StepProfiler``: one rank's spans, step by step, and the overlap figures computed from them.

Sources, all at boundaries that already exist:
* the engine reports its phases (``forward``, ``backward`` up to the end of autograd,
  ``optimizer``) through ``record``; waits (the end-of-backward reduction wait, the parameter
  all-gather, stage 3's waits for gathered parameters) are not compute: a wait inside a compute
  phase is cut out of it;
* optional per-block forward/backward spans from module hooks (``blocks=``);
* every collective's span from the comms logger's records (launch to completion, timed by the
  backend's completion callback), which the profiler switches on while it is attached; tensor
  parallelism's all-reduces on a lane of their own, and, per kind (forward, backward), their
  bytes, T_comm, the time the rank sat waiting for them and the hidden share eta_TP; a
  pipeline's sends and receives on a lane of their own too, outside eta (a receive is posted
  long before it is awaited: ``PipelineEngine.pipeline_report`` measures their exposed time).

Use it around any loop::

    with StepProfiler(engine, blocks=model.blocks) as prof:
        for batch in data: ...
    prof.summary()          # mean T_compute, T_comm, exposed comm, eta, step vs ideal/serial,
                            # and tp_forward_* / tp_backward_* (bytes, comm_s, exposed_s, eta)
    prof.export("runs/x")   # trace.json (Perfetto) and timeline.png, all ranks
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import torch

import zerolap.comm as dist
from zerolap.comm.logger import COMMS_LOGGER
from zerolap.profiling.intervals import subtract
from zerolap.profiling.overlap import Exposure, OverlapStats, exposure, overlap_stats
from zerolap.profiling.timeline import (
    COMM,
    COMPUTE,
    P2P_COMM,
    TP_COMM,
    Span,
    write_chrome_trace,
    write_timeline_png,
)
from zerolap.tensor_parallel.mappings import KINDS as TP_KINDS

__all__ = ["StepProfiler"]

# A pipeline's messages: a receive is posted long before it is awaited, so its span is not
# time spent communicating; the pipeline's own report measures their exposed time.
_P2P_OPS = frozenset({"isend", "irecv"})


class StepProfiler:
    def __init__(self, engine, *, blocks: Iterable[torch.nn.Module] | None = None) -> None:
        self.engine = engine
        self.rank = dist.get_rank()
        self.spans: list[Span] = []
        self.stats: list[OverlapStats] = []
        self.tp: list[dict[str, Exposure]] = []  # per step: tensor-parallel all-reduces
        self.step = 0
        self._step_start: float | None = None
        self._records_seen = 0
        self._running: list = []  # records of collectives a closed step left running
        self._waits: list[tuple[float, float]] = []  # this step's waits, reported by the engine
        self._hooks = []
        self._block_starts: dict[str, float] = {}
        self._logger_config = COMMS_LOGGER.config
        for index, block in enumerate(blocks or []):
            self._hook_block(f"block{index}", block)

    # -- attaching ---------------------------------------------------------------------------

    def __enter__(self) -> StepProfiler:
        dist.configure(enabled=True, prof_all=True)
        self._records_seen = len(COMMS_LOGGER.records)
        self.engine.add_phase_recorder(self)
        return self

    def __exit__(self, *exc) -> None:
        self.engine.remove_phase_recorder(self)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        dist.configure(self._logger_config)

    def _hook_block(self, name: str, block: torch.nn.Module) -> None:
        def opener(phase):
            def hook(*_):
                self._block_starts[f"{phase}:{name}"] = time.perf_counter()

            return hook

        def closer(phase):
            def hook(*_):
                key = f"{phase}:{name}"
                if key in self._block_starts:
                    self._add(COMPUTE, key, self._block_starts.pop(key), time.perf_counter())

            return hook

        self._hooks += [
            block.register_forward_pre_hook(opener("forward")),
            block.register_forward_hook(closer("forward")),
            block.register_full_backward_pre_hook(opener("backward")),
            block.register_full_backward_hook(closer("backward")),
        ]

    # -- recording ---------------------------------------------------------------------------

    def _add(self, lane: str, name: str, start: float, end: float) -> None:
        self.spans.append(Span(self.rank, lane, name, start, end, self.step))

    def record(self, phase: str, start: float, end: float, compute: bool = True) -> None:
        """A phase reported by the engine; ``step_end`` closes the step. Waits
        (``compute=False``) are not compute: the collectives' own spans cover them."""
        if self._step_start is None:
            self._step_start = start
        if phase == "step_end":
            self._close_step(end)
        elif compute:
            self._add(COMPUTE, phase, start, end)
        else:
            self._waits.append((start, end))

    def _close_step(self, end: float) -> None:
        # Collectives still running when a step ends (stages 1-2 leave the parameter gathers
        # in flight for the next forward) are counted with the step in which they complete.
        records = self._running + COMMS_LOGGER.records[self._records_seen :]
        for record in records:
            record.resolve()
        self._running = [r for r in records if not r.closed]
        records = [r for r in records if r.closed]
        for record in records:
            tp = record.name in TP_KINDS
            lane = TP_COMM if tp else P2P_COMM if record.op in _P2P_OPS else COMM
            if record.end is not None:
                self._add(lane, record.op, record.start, record.end)
            if tp:
                # The computing thread (or lane, the other one idle) sat in it, inside a compute
                # phase: not compute. (Other ops may be waited for off that thread.)
                self._waits += record.blocked()
        self._records_seen = len(COMMS_LOGGER.records)
        self.tp.append(exposure(records, TP_KINDS))
        start = self._step_start
        mine = [s for s in self.spans if s.step == self.step]
        compute = [(s.start, s.end) for s in mine if s.lane == COMPUTE and ":" not in s.name]
        # A wait inside a compute phase (stage 3's forward blocked on a gather) computes nothing.
        compute = subtract(compute, self._waits)
        self._waits = []
        comm = [(s.start, s.end) for s in mine if s.lane in (COMM, TP_COMM)]
        self.stats.append(overlap_stats(compute, comm, step=(start, end)))
        self.step += 1
        self._step_start = None

    # -- results -----------------------------------------------------------------------------

    def summary(self, skip: int = 1) -> dict[str, float]:
        """Mean per-step figures over the steps after the first ``skip`` (warm-up)."""
        stats = self.stats[skip:] or self.stats
        if not stats:
            return {}
        keys = stats[0].as_dict().keys()
        mean = {k: sum(s.as_dict()[k] for s in stats) / len(stats) for k in keys}
        comm = mean["comm_s"]
        mean["eta"] = 1.0 if comm == 0 else 1 - mean["exposed_comm_s"] / comm
        mean["steps"] = len(stats)
        tp = self.tp[skip:] if len(self.tp) > skip else self.tp
        for kind in TP_KINDS:
            steps = [each[kind] for each in tp if each[kind].count]
            if not steps:
                continue
            short = kind.removesuffix("_all_reduce")  # tp_forward, tp_backward
            per_step = Exposure(
                count=sum(e.count for e in steps) // len(steps),
                message_bytes=sum(e.message_bytes for e in steps) // len(steps),
                comm_s=sum(e.comm_s for e in steps) / len(steps),
                exposed_s=sum(e.exposed_s for e in steps) / len(steps),
            )
            mean[f"{short}_bytes"] = per_step.message_bytes
            mean[f"{short}_comm_s"] = per_step.comm_s
            mean[f"{short}_exposed_s"] = per_step.exposed_s
            mean[f"{short}_eta"] = per_step.eta
        return mean

    def gather_spans(self) -> list[Span]:
        """Every rank's spans, on every rank (a collective: all ranks must call it)."""
        if dist.get_world_size() == 1:
            return list(self.spans)
        gathered: list = [None] * dist.get_world_size()
        torch.distributed.all_gather_object(gathered, self.spans)
        return [span for spans in gathered for span in spans]

    def export(
        self, directory: str | Path, *, steps: Iterable[int] | None = None, title: str = ""
    ) -> tuple[Path, Path] | None:
        """Write ``trace.json`` and ``timeline.png`` of all ranks (of ``steps``, or all) on
        rank 0. A collective: every rank must call it."""
        spans = self.gather_spans()
        if steps is not None:
            keep = set(steps)
            spans = [s for s in spans if s.step in keep]
        if self.rank != 0:
            return None
        directory = Path(directory)
        return (
            write_chrome_trace(spans, directory / "trace.json"),
            write_timeline_png(spans, directory / "timeline.png", title=title),
        )
