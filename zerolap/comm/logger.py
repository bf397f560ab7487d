"""The comms logger: one record per collective, aggregated into a summary on demand.

Every op in ``zerolap.comm`` calls ``COMMS_LOGGER.start`` when ``COMMS_LOGGER.enabled`` is true
(the one branch paid when it is off) and the record is closed when the op *completes*:

* CPU/gloo: the work's future fires a callback on the backend's thread; nothing waits for it.
* CUDA/NCCL: a CUDA event is recorded on the caller's stream at launch and another once the
  caller's stream has waited for the op; their gap is read only when a summary is asked for.

So an asynchronous op keeps running in the background while it is timed, unlike a logger that
synchronises the device around each op. The profiler's overlap figures and timelines read the same
``records`` list.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as torch_dist

from zerolap.comm.volume import bus_factor
from zerolap.config.comms_logger import CommsLoggerConfig
from zerolap.utils.logging import logger as log

__all__ = [
    "COMMS_LOGGER",
    "CommRecord",
    "CommsLogger",
    "configure",
    "get_comm_operation_count",
    "get_logged_comm_ops",
    "has_comm_data",
    "log_summary",
    "logged",
    "reset_log",
]


@dataclass(slots=True)
class CommRecord:
    """One collective as this rank saw it. Times are ``time.perf_counter()`` seconds."""

    op: str
    message_bytes: int
    wire_bytes: int
    group_size: int
    start: float
    end: float | None = None
    cuda_events: tuple | None = None  # (start, end) events, resolved lazily
    launched: float | None = None
    """When the launching call returned to the caller (async ops)."""
    waited: tuple[float, float] | None = None
    """When the caller blocked in ``wait()`` for it."""
    bus: float = 1.0
    """nccl-tests' bus-bandwidth factor of the collective (``op`` may be a caller's log name)."""

    @property
    def name(self) -> str:
        """The op's name without the caller that ``debug`` appends."""
        return self.op.partition(" | ")[0]

    def blocked(self) -> list[tuple[float, float]]:
        """When the caller sat in this op rather than computing: in the launching call, and
        in ``wait()``."""
        spans = [] if self.launched is None else [(self.start, self.launched)]
        return spans + ([] if self.waited is None else [self.waited])

    @property
    def closed(self) -> bool:
        return self.end is not None or (
            self.cuda_events is not None and self.cuda_events[1] is not None
        )

    @property
    def latency(self) -> float | None:
        self.resolve()
        return None if self.end is None else self.end - self.start

    def resolve(self) -> None:
        """Turn recorded CUDA events into an end time (blocks only on those events)."""
        if self.end is None and self.cuda_events is not None and self.cuda_events[1] is not None:
            start_event, end_event = self.cuda_events
            end_event.synchronize()
            self.end = self.start + start_event.elapsed_time(end_event) / 1e3


@dataclass
class CommsLogger:
    config: CommsLoggerConfig = field(default_factory=CommsLoggerConfig)
    records: list[CommRecord] = field(default_factory=list)
    enabled: bool = False  # mirrors config.enabled; read on every op

    def configure(self, config: CommsLoggerConfig) -> None:
        self.config = config
        self.enabled = config.enabled

    def wants(self, op: str) -> bool:
        return self.config.prof_all or op in self.config.prof_ops

    def start(
        self,
        op: str,
        message_bytes: int,
        wire_bytes: int,
        group_size: int,
        device: torch.device,
        *,
        collective: str | None = None,
    ) -> CommRecord | None:
        """Open a record named ``op``; ``collective``: the op that runs when ``op`` is the
        name a caller logs it under (``log_name``)."""
        if not self.wants(op):
            return None
        bus = bus_factor(collective or op, group_size)
        if self.config.debug:
            op = f"{op} | [Caller Func: {_caller_name()}]"
        record = CommRecord(op, message_bytes, wire_bytes, group_size, time.perf_counter(), bus=bus)
        if device.type == "cuda":
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
            record.cuda_events = (start_event, None)
        self.records.append(record)
        return record

    def finish(self, record: CommRecord) -> None:
        """Close ``record`` once the op has completed (or the caller's stream waited for it);
        the first call wins, later ones do nothing."""
        if record.closed:
            return
        if record.cuda_events is not None:
            end_event = torch.cuda.Event(enable_timing=True)
            end_event.record()
            record.cuda_events = (record.cuda_events[0], end_event)
        else:
            record.end = time.perf_counter()
        if self.config.verbose:
            self._print_one(record)

    def _print_one(self, record: CommRecord) -> None:
        latency = record.latency or 0.0
        algbw = record.message_bytes / latency / 1e9 if latency > 0 else 0.0
        busbw = algbw * record.bus
        log.info(
            f"comm op: {record.op} | time (ms): {latency * 1e3:.3f} | "
            f"msg size: {_human_bytes(record.message_bytes)} | algbw (GB/s): {algbw:.3f} | "
            f"busbw (GB/s): {busbw:.3f}"
        )

    def reset(self) -> None:
        self.records.clear()

    def aggregate(self) -> dict[str, dict[int, dict[str, float]]]:
        """``{op: {message_bytes: stats}}`` over completed records."""
        groups: dict[tuple[str, int], list[CommRecord]] = defaultdict(list)
        for record in self.records:
            if record.latency is not None:
                groups[(record.op, record.message_bytes)].append(record)
        summary: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
        for (op, size), records in sorted(groups.items()):
            total = sum(r.latency for r in records)  # type: ignore[misc]
            count = len(records)
            avg = total / count
            algbw = size / avg / 1e9 if avg > 0 else 0.0
            summary[op][size] = {
                "count": count,
                "total_latency_ms": total * 1e3,
                "avg_latency_ms": avg * 1e3,
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * records[0].bus,
                "wire_bytes": sum(r.wire_bytes for r in records),
            }
        return dict(summary)


def _caller_name() -> str:
    # Skip this module and zerolap.comm's own frames to name the user's function.
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("zerolap.comm"):
        frame = frame.f_back
    return frame.f_code.co_name if frame is not None else "?"


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GB"


COMMS_LOGGER = CommsLogger()


def configure(
    config: Mapping | CommsLoggerConfig | None = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> CommsLoggerConfig:
    """Set up the comms logger from a ds_config (or its ``comms_logger`` block) and keywords;
    keywords win. Returns the configuration in force."""
    if isinstance(config, CommsLoggerConfig):
        base = config.model_dump()
    elif config is None:
        base = COMMS_LOGGER.config.model_dump()
    else:
        base = dict(config.get("comms_logger", config))
    overrides = dict(
        enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose, debug=debug
    )
    base.update({k: v for k, v in overrides.items() if v is not None})
    COMMS_LOGGER.configure(CommsLoggerConfig.model_validate(base))
    return COMMS_LOGGER.config


def reset_log() -> None:
    COMMS_LOGGER.reset()


@contextmanager
def logged(op: str, group_size: int, device: torch.device) -> Iterator[CommRecord | None]:
    """One record around a synchronous op made of several backend calls (the object
    collectives, ``monitored_barrier``), closed when the block ends. Yields the record, or None
    when the op is not logged; the caller fills in its byte counts once it knows them."""
    record = COMMS_LOGGER.start(op, 0, 0, group_size, device) if COMMS_LOGGER.enabled else None
    try:
        yield record
    finally:
        if record is not None:
            COMMS_LOGGER.finish(record)


def _completed_ops() -> list[str]:
    return [record.op for record in COMMS_LOGGER.records if record.closed]


def has_comm_data() -> bool:
    """Whether the comms logger has recorded a completed op since the last ``reset_log``."""
    return bool(_completed_ops())


def get_comm_operation_count() -> int:
    """Completed ops recorded since the last ``reset_log``, over all op names and sizes."""
    return len(_completed_ops())


def get_logged_comm_ops() -> list[str]:
    """The names of the ops recorded since the last ``reset_log``, in order of first use."""
    return list(dict.fromkeys(_completed_ops()))


def _straggler_ms(summary: dict) -> dict[tuple[str, int], float]:
    """Per (op, size): slowest rank's total latency minus the fastest's."""
    totals = {
        (op, size): s["total_latency_ms"] for op, by in summary.items() for size, s in by.items()
    }
    gathered: list[dict] = [None] * torch_dist.get_world_size()  # type: ignore[list-item]
    torch_dist.all_gather_object(gathered, totals)
    return {
        key: max(g.get(key, 0.0) for g in gathered) - min(g.get(key, 0.0) for g in gathered)
        for key in totals
    }


def log_summary(show_straggler: bool = False) -> dict:
    """Print the per-op table on rank 0 and return it as a dict on every rank.

    With ``show_straggler`` every rank must call this (it all-gathers the latencies) and each row
    gains ``straggler_ms``: how much longer the slowest rank spent in that op than the fastest.
    """
    summary = COMMS_LOGGER.aggregate()
    if show_straggler and torch_dist.is_initialized():
        for (op, size), gap in _straggler_ms(summary).items():
            summary[op][size]["straggler_ms"] = gap
    rank = torch_dist.get_rank() if torch_dist.is_initialized() else 0
    if rank == 0:
        log.info(format_summary(summary, show_straggler))
    return summary


def format_summary(summary: dict, show_straggler: bool = False) -> str:
    header = ["Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)"]
    header += ["algbw (GB/s)", "busbw (GB/s)"] + (["Straggler(ms)"] if show_straggler else [])
    rows = [header]
    for op, by_size in summary.items():
        for size, s in by_size.items():
            row = [op, _human_bytes(size), str(s["count"]), f"{s['total_latency_ms']:.2f}"]
            row += [
                f"{s['avg_latency_ms']:.3f}",
                f"{s['algbw_gbps']:.3f}",
                f"{s['busbw_gbps']:.3f}",
            ]
            if show_straggler:
                row.append(f"{s.get('straggler_ms', 0.0):.2f}")
            rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
