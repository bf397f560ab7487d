"""The ``comms_logger`` section of ds_config."""

from __future__ import annotations

from pydantic import Field

from zerolap.config.section import ConfigSection

__all__ = ["CommsLoggerConfig"]


class CommsLoggerConfig(ConfigSection):
    """What the comms logger records and prints (``zerolap.comm.configure``)."""

    enabled: bool = False
    """Record every logged collective: count, bytes, latency, bandwidth."""
    verbose: bool = False
    """Print one line per collective as it completes."""
    prof_all: bool = True
    """Profile every op; when false only the ops named in ``prof_ops``."""
    prof_ops: list[str] = Field(default_factory=list)
    """Op names to profile when ``prof_all`` is false (e.g. ``["all_reduce"]``)."""
    debug: bool = False
    """Add the calling function's name to each op's entry."""
