"""Model-state memory per device for every ZeRO stage, from the ZeRO paper's formulas.

Per parameter, with p/g bytes of parameter/gradient, m of fp32 master weights and k of optimizer
state (Adam: 8, two fp32 moments), on N data-parallel ranks:

    stage 0: p + g + m + k        stage 2: p + (g + m + k) / N
    stage 1: p + g + (m + k) / N  stage 3: (p + g + m + k) / N

Mixed precision is p = g = 2, m = 4, k = 8 (the paper's K = 12): 7.5B parameters on 64 ranks
need 120, 31.4, 16.6 and 1.88 GB (the paper's Table 1). fp32 as zerolap trains it keeps no
master copy (p = g = 4, m = 0, k = 8). bf16 masters (``bf16.bf16_master_weights_and_grads`` with
``bf16_optimizer_states``, ZeRO stages 1-3, no offload) keep none either: p = g = 2, m = 0,
k = 4.

Offload (stages 1-3), as zerolap places it from an accelerator: the optimizer's share moves to
host memory (``device: cpu``) or to disk (``device: nvme``), with an fp32 master even for fp32
weights (the host cannot step the device's own parameters); at stages 2-3 the gradient shard,
g / N, moves to host memory as well; at stage 3 ``offload_param`` moves the parameter shard,
p / N, too (to the host, where fp32 weights are then stepped in place, without a master; or to
disk, with one). On a CPU-only host the "device" is host memory, and only ``nvme`` changes what
is resident.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "PRECISIONS",
    "ZERO_ONLY",
    "Placement",
    "bytes_per_param",
    "estimate_model_states",
    "estimate_offload",
    "offload_placement",
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
    # bf16.bf16_master_weights_and_grads + bf16_optimizer_states: no master, bf16 moments;
    # a ZeRO optimizer's (stages 1-3) and never offloaded.
    "bf16-masters": Precision(param=2, grad=2, master=0, state=4),
}
ZERO_ONLY = frozenset({"bf16-masters"})
"""Precisions that exist at ZeRO stages 1-3 only, without offload."""


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


@dataclass(frozen=True)
class Placement:
    """Bytes per rank in each tier."""

    device: float
    host: float = 0.0
    disk: float = 0.0


def offload_placement(stage: int, world_size: int, precision: Precision, tier: str) -> Placement:
    """Bytes per parameter in each tier with ``offload_optimizer`` (and at stage 3
    ``offload_param``) on ``tier``, ``cpu`` or ``nvme``, from an accelerator (stages 1-3)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"offload needs ZeRO stage 1, 2 or 3; got {stage}")
    p, g, k, n = precision.param, precision.grad, precision.state, world_size
    in_place = stage == 3 and tier == "cpu" and precision.master == 0  # fp32 shard on the host
    m = 0 if in_place else 4
    device = {1: p + g, 2: p, 3: 0.0}[stage]
    grads = g / n if stage > 1 else 0.0  # the gradient shard's tail lives on the host
    moved = (m + k + (p if stage == 3 else 0)) / n
    if tier == "cpu":
        return Placement(device=device, host=moved + grads)
    return Placement(device=device, host=grads, disk=moved)


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
    (stage 0: ``none`` only; a ``ZERO_ONLY`` precision: stages 1-3, ``none`` only)."""
    chosen = _checked(numel, world_size, precision)
    zero_only = precision in ZERO_ONLY
    out: dict[int, dict[str, Placement]] = {}
    for stage in range(4):
        out[stage] = {}
        if zero_only and stage == 0:
            continue
        out[stage]["none"] = Placement(device=numel * bytes_per_param(stage, world_size, chosen))
        for tier in ("cpu", "nvme") if stage > 0 and not zero_only else ():
            per_param = offload_placement(stage, world_size, chosen, tier)
            out[stage][tier] = Placement(
                device=numel * per_param.device,
                host=numel * per_param.host,
                disk=numel * per_param.disk,
            )
    return out
