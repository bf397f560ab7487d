"""Model-state memory per device for every ZeRO stage, from the ZeRO paper's formulas.

Per parameter, with p/g bytes of parameter/gradient, m of fp32 master weights and k of optimizer
state (Adam: 8, two fp32 moments), on N data-parallel ranks:

    stage 0: p + g + m + k        stage 2: p + (g + m + k) / N
    stage 1: p + g + (m + k) / N  stage 3: (p + g + m + k) / N

Mixed precision is p = g = 2, m = 4, k = 8 (the paper's K = 12): 7.5B parameters on 64 ranks
need 120, 31.4, 16.6 and 1.88 GB (the paper's Table 1). fp32 as zerolap trains it keeps no
master copy (p = g = 4, m = 0, k = 8).

Offload (stages 1-3) moves the optimizer's share, (m + k) / N, off the device: to host memory
(``device: cpu``) or to disk (``device: nvme``); at stage 3 ``offload_param`` moves the
parameter shard, p / N, too. Gradients stay on the device. On a CPU-only host the "device" is
host memory, and only ``nvme`` changes what is resident.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "PRECISIONS",
    "Placement",
    "bytes_per_param",
    "estimate_model_states",
    "estimate_offload",
    "offloaded_bytes_per_param",
]


@dataclass(frozen=True)
class Precision:
    param: int
    grad: int
    master: int
    state: int


PRECISIONS = {
    "mixed": Precision(param=2, grad=2, master=4, state=8),
    "fp32": Precision(param=4, grad=4, master=0, state=8),
}


def bytes_per_param(stage: int, world_size: int, precision: Precision) -> float:
    p, g, m, k, n = precision.param, precision.grad, precision.master, precision.state, world_size
    if stage == 0:
        return p + g + m + k
    if stage == 1:
        return p + g + (m + k) / n
    if stage == 2:
        return p + (g + m + k) / n
    if stage == 3:
        return (p + g + m + k) / n
    raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3; got {stage}")


def offloaded_bytes_per_param(stage: int, world_size: int, precision: Precision) -> float:
    """Bytes per parameter that offload moves off the device (none at stage 0, which has no
    partitioned optimizer to offload)."""
    if stage == 0:
        return 0.0
    moved = (precision.master + precision.state) / world_size
    if stage == 3:
        moved += precision.param / world_size
    return moved


@dataclass(frozen=True)
class Placement:
    """Bytes per rank in each tier."""

    device: float
    host: float = 0.0
    disk: float = 0.0


def _checked(numel: float, world_size: int, precision: str) -> Precision:
    if world_size < 1:
        raise ValueError(f"world size must be >= 1; got {world_size}")
    if numel <= 0:
        raise ValueError(f"the number of parameters must be positive; got {numel}")
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ValueError(
            f"precision must be one of {sorted(PRECISIONS)}; got {precision!r}"
        ) from None


def estimate_model_states(
    numel: float, world_size: int, precision: str = "mixed"
) -> dict[int, float]:
    """Bytes per device for stages 0-3."""
    chosen = _checked(numel, world_size, precision)
    return {stage: numel * bytes_per_param(stage, world_size, chosen) for stage in range(4)}


def estimate_offload(
    numel: float, world_size: int, precision: str = "mixed"
) -> dict[int, dict[str, Placement]]:
    """Per stage, where the model states live with offload ``none``, ``cpu`` and ``nvme``
    (stage 0: ``none`` only)."""
    chosen = _checked(numel, world_size, precision)
    out: dict[int, dict[str, Placement]] = {}
    for stage in range(4):
        total = numel * bytes_per_param(stage, world_size, chosen)
        moved = numel * offloaded_bytes_per_param(stage, world_size, chosen)
        out[stage] = {"none": Placement(device=total)}
        if stage > 0:
            out[stage]["cpu"] = Placement(device=total - moved, host=moved)
            out[stage]["nvme"] = Placement(device=total - moved, disk=moved)
    return out
