"""``zero_optimization.offload_param`` and ``zero_optimization.offload_optimizer``: keeping
parameter shards or optimizer state (and the optimizer step) in CPU memory.

zerolap offloads to CPU memory only; ``device: "nvme"`` is an error, and the keys that only
configure NVMe swapping are accepted and reported as unsupported. Which ZeRO stages allow which
offload is checked by the ``zero_optimization`` section.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field

from zerolap.config.errors import Problem
from zerolap.config.section import ConfigSection, DeepSpeedOnly

__all__ = ["OffloadDevice", "OffloadOptimizerConfig", "OffloadParamConfig"]

OffloadDevice = Literal["none", "cpu", "nvme"]
"""Where offloaded state lives; ``none`` keeps it on the accelerator."""

_NVME = "NVMe offload is not supported by zerolap; use 'cpu' or 'none'"


class _Offload(ConfigSection):
    device: OffloadDevice = "none"
    """Where the offloaded state lives: ``none`` (the accelerator) or ``cpu``."""
    pin_memory: bool = True
    """Use page-locked CPU memory: faster copies, less memory for everything else (on by
    default, as in DeepSpeed 0.19.8)."""

    @property
    def enabled(self) -> bool:
        """Whether anything is offloaded."""
        return self.device != "none"

    def _check(self, context: Mapping[str, Any]) -> list[Problem]:
        if self.device == "nvme":
            return [Problem(("device",), f"got 'nvme'; {_NVME}")]
        return []


class OffloadParamConfig(_Offload):
    """``zero_optimization.offload_param``: keep stage-3 parameter shards in CPU memory between
    uses. Valid only with ZeRO stage 3."""

    nvme_path: Annotated[str | None, DeepSpeedOnly()] = None
    """Directory on the NVMe device (NVMe offload only)."""
    buffer_count: Annotated[int, DeepSpeedOnly()] = Field(5, ge=0)
    """Buffers in the NVMe swap pool (NVMe offload only)."""
    buffer_size: Annotated[int, DeepSpeedOnly()] = Field(100_000_000, ge=0)
    """Size of each NVMe swap buffer, in elements (NVMe offload only)."""
    max_in_cpu: Annotated[int, DeepSpeedOnly()] = Field(1_000_000_000, ge=0)
    """Parameter elements kept in CPU memory when swapping to NVMe (NVMe offload only)."""


class OffloadOptimizerConfig(_Offload):
    """``zero_optimization.offload_optimizer``: keep the optimizer state shard in CPU memory and
    run the optimizer step there. Valid with ZeRO stages 1, 2 and 3."""

    ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of the optimizer state offloaded; below 1 only with ZeRO stage 3."""
    nvme_path: Annotated[str | None, DeepSpeedOnly()] = None
    """Directory on the NVMe device (NVMe offload only)."""
    buffer_count: Annotated[int, DeepSpeedOnly()] = Field(4, ge=0)
    """Buffers in the NVMe swap pool (NVMe offload only)."""
    pipeline_read: Annotated[bool, DeepSpeedOnly()] = False
    """Overlap reading the next NVMe tile with the current step (NVMe offload only)."""
    pipeline_write: Annotated[bool, DeepSpeedOnly()] = False
    """Overlap writing the previous NVMe tile with the current step (NVMe offload only)."""
    fast_init: Annotated[bool, DeepSpeedOnly()] = False
    """Faster optimizer initialisation when offloading to NVMe (NVMe offload only)."""
    super_offload: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed's offload tuned for superchips (Grace Hopper and the like)."""
    convert_grad_on_cpu: Annotated[bool, DeepSpeedOnly()] = True
    """DeepSpeed converts offloaded gradients to fp32 on the CPU rather than the accelerator."""
    cpuadam_cores_perc: Annotated[float, DeepSpeedOnly()] = Field(0.8, ge=0.0, le=1.0)
    """Share of CPU cores DeepSpeed's CPU Adam uses with ``super_offload``."""
