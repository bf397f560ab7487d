"""zerolap's logger: every message the library prints goes through it.

It is a plain ``logging.Logger`` named ``zerolap`` (``deepspeed.utils.logger`` under the shim),
so a client that sets its level (the Hugging Face Trainer sets it to the process's log level)
governs every message: configuration warnings, stage-3 trace misses, wall-clock breakdowns,
the comms summary. It writes to stderr with its own handler and does not propagate, as
DeepSpeed's does, so an application's root handlers do not print each line twice.
"""

from __future__ import annotations

import functools
import logging
import sys

__all__ = ["log_dist", "logger", "set_log_level_from_string", "warning_once"]

logger = logging.getLogger("zerolap")
logger.setLevel(logging.INFO)
logger.propagate = False
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("[zerolap] %(levelname)s: %(message)s"))
    logger.addHandler(_handler)


def _rank() -> int | None:
    import torch.distributed as torch_dist

    return torch_dist.get_rank() if torch_dist.is_initialized() else None


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` prefixed with the rank, on the ranks listed (``[-1]``: all of them);
    without a process group every process logs. DeepSpeed's signature."""
    rank = _rank()
    if rank is not None and not (ranks and (ranks[0] == -1 or rank in ranks)):
        return
    logger.log(level, f"[Rank {-1 if rank is None else rank}] {message}")


_LEVELS = {"debug", "info", "warning", "error", "critical"}


def set_log_level_from_string(log_level_str: str, custom_logger=None) -> None:
    """Set ``custom_logger`` (zerolap's by default) and its handlers to the level named
    ("debug", "info", "warning", "error" or "critical", in any case); ds_config's
    ``log_level``. DeepSpeed's signature."""
    name = log_level_str.lower()
    if name not in _LEVELS:
        raise ValueError(f"log level {log_level_str!r}: use one of {', '.join(sorted(_LEVELS))}")
    target = custom_logger if custom_logger is not None else logger
    target.setLevel(name.upper())
    for handler in target.handlers:
        handler.setLevel(name.upper())


@functools.lru_cache(None)
def warning_once(message: str) -> None:
    """``logger.warning(message)``, once per process for each distinct message."""
    logger.warning(message)


logger.warning_once = warning_once  # DeepSpeed's logger has this method too
