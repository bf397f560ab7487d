"""``zero_optimization.offload_optimizer`` and ``zero_optimization.offload_param``: optimizer
state and stage-3 parameter shards kept off the accelerator, in host memory (``cpu``) or in swap
files on disk (``nvme``, any filesystem: zerolap uses plain POSIX I/O, no libaio).

Keys and defaults are DeepSpeed 0.19.8's. Where DeepSpeed limits a key, zerolap does what the key
says and the docstrings note the difference: NVMe optimizer offload works at stages 1, 2 and 3
(DeepSpeed: stage 3 only) and ``ratio`` applies at every stage. Which stages allow which
offload at all is checked by the ``zero_optimization`` section.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field

from zerolap.config.errors import Problem
from zerolap.config.section import ConfigSection, DeepSpeedOnly

__all__ = ["OffloadDevice", "OffloadOptimizerConfig", "OffloadParamConfig"]

OffloadDevice = Literal["none", "cpu", "nvme"]
"""Where offloaded state lives: ``none`` (where training runs), ``cpu`` or ``nvme``."""


class _Offload(ConfigSection):
    device: OffloadDevice = "none"
    """Where the offloaded state lives: ``none`` (where training runs), ``cpu`` (host memory;
    on a CPU-only host, where everything already is) or ``nvme`` (swap files under
    ``nvme_path``)."""
    nvme_path: str | None = None
    """Directory for the swap files with ``device: nvme``; it must exist and be writable. The
    files are scratch, removed when the engine is destroyed or the process exits."""
    pin_memory: bool = True
    """Page-locked host buffers, so an accelerator copies to and from them faster (on by default,
    as in DeepSpeed 0.19.8). Without an accelerator there is nothing to pin for."""
    buffer_count: int = Field(4, ge=1)
    """With ``device: nvme``: buffers the swapped state streams through; up to this many
    transfers are in flight while the current one is used."""

    @property
    def enabled(self) -> bool:
        """Whether anything is offloaded."""
        return self.device != "none"

    def _check(self, context: Mapping[str, Any]) -> list[Problem]:
        if self.device == "nvme" and not self.nvme_path:
            return [Problem(("nvme_path",), "device 'nvme' needs nvme_path, a directory")]
        return []


class OffloadParamConfig(_Offload):
    """``zero_optimization.offload_param``: stage-3 parameter shards kept off the accelerator
    between uses. Valid only with ZeRO stage 3."""

    buffer_count: int = Field(5, ge=1)
    """With ``device: nvme``: buffers parameter shards are read into; at most this many units'
    shards are in memory at once, beyond those kept by ``max_in_cpu``."""
    buffer_size: int = Field(100_000_000, ge=1)
    """With ``device: nvme``: elements of each buffer; a unit's shard larger than this is an
    error naming the unit."""
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    """With ``device: nvme``: shard elements per rank kept in memory rather than swapped,
    given to units in their order (the modules' registration order); units kept whole
    (``stage3_param_persistence_threshold``) always stay. The default keeps models up to a
    billion elements per rank in memory: set it lower (0: every sharded unit) to swap."""


class OffloadOptimizerConfig(_Offload):
    """``zero_optimization.offload_optimizer``: the optimizer state (and the fp32 master values,
    where there are any) kept off the accelerator, and the optimizer step run where they are.
    Valid with ZeRO stages 1, 2 and 3."""

    ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Share of this rank's optimizer elements offloaded, counted in whole sub-groups
    (``sub_group_size``) from the last; the first ones stay where training runs and step first,
    while the offloaded ones are brought in. DeepSpeed applies it at stage 3 only."""
    pipeline_read: bool = True
    """With ``device: nvme``: read the next sub-groups while the current one steps (and start
    the first reads during the last backward of the step). False reads each one when it is
    needed. (DeepSpeed's default is false; on by default here: it changes no value.)"""
    pipeline_write: bool = True
    """With ``device: nvme``: write sub-groups back in the background, the last ones finishing
    under the next forward. False waits for each write. (DeepSpeed's default is false.)"""
    defer_step: bool = True
    """With ``device: nvme`` at stages 1-2 (zerolap's own key): ``step()`` returns once the
    sub-groups kept in memory have stepped; each swapped one steps just before the all-gather
    of the first bucket the next forward needs from it, on the thread that runs the gathers, so
    that its reads and writes run under the next forward (``zero.step_behind``). The results are
    the same; every reader of the parameters or the optimizer state waits for it. It needs
    ``overlap_param_gather``, gloo's ring gathers on a CPU-only host, no tensor, pipeline or
    expert parallelism, and torch's or zerolap's optimizers; elsewhere (said at start), in a
    step whose optimizer has step hooks, and with false, the whole step runs inside ``step()``,
    as in DeepSpeed."""
    fast_init: bool = False
    """DeepSpeed fills the swap files at start with a dummy step unless set; zerolap always
    starts the fast way (space allocated at start, each sub-group's state written by its first
    step), so both values give the same run."""
    super_offload: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed's offload tuned for superchips (Grace Hopper and the like)."""
    convert_grad_on_cpu: Annotated[bool, DeepSpeedOnly()] = True
    """DeepSpeed converts offloaded gradients to fp32 on the CPU rather than the accelerator."""
    cpuadam_cores_perc: Annotated[float, DeepSpeedOnly()] = Field(0.8, ge=0.0, le=1.0)
    """Share of CPU cores DeepSpeed's CPU Adam uses with ``super_offload``."""
