"""The ``flops_profiler`` section of ds_config (DeepSpeed's keys and defaults)."""

from __future__ import annotations

from pydantic import Field

from zerolap.config.section import ConfigSection

__all__ = ["FlopsProfilerConfig"]


class FlopsProfilerConfig(ConfigSection):
    """Rank 0 profiles the model once (``zerolap.profiling.flops``; when, and what it prints,
    in ``zerolap.runtime.flops_profiling``)."""

    enabled: bool = False
    """Profile the model once during training."""
    recompute_fwd_factor: float = Field(0.0, ge=0, allow_inf_nan=False)
    """The share of the forward recomputed in the backward (activation checkpointing: 1.0 for
    all of it), counted into the backward's flops (2 forwards' worth, plus this)."""
    profile_step: int = Field(1, ge=0)
    """The optimizer step (counted from 0) whose latencies are printed (the first one after it
    that trains, in a run resumed past it): its training forwards are timed module by module,
    and the next training forward is counted."""
    module_depth: int = Field(-1, ge=-1)
    """How deep the aggregated and detailed views go; -1 for every depth."""
    top_modules: int = Field(1, ge=1)
    """How many module types the aggregated view names at each depth."""
    detailed: bool = True
    """Print the module tree with each module's profile."""
    output_file: str | None = None
    """Write the profile to this file instead of standard output."""
