"""Model-state memory per device for every ZeRO stage, from the ZeRO paper's formulas.

Per parameter, with p/g bytes of parameter/gradient, m of fp32 master weights and k of optimizer
state (Adam: 8, two fp32 moments), on N data-parallel ranks:

    stage 0: p + g + m + k        stage 2: p + (g + m + k) / N
    stage 1: p + g + (m + k) / N  stage 3: (p + g + m + k) / N

Mixed precision is p = g = 2, m = 4, k = 8 (the paper's K = 12): 7.5B parameters on 64 ranks
need 120, 31.4, 16.6 and 1.88 GB (the paper's Table 1). fp32 as zerolap trains it keeps no
master copy (p = g = 4, m = 0, k = 8).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRECISIONS", "bytes_per_param", "estimate_model_states"]


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


def estimate_model_states(
    numel: float, world_size: int, precision: str = "mixed"
) -> dict[int, float]:
    """Bytes per device for stages 0-3."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1; got {world_size}")
    if numel <= 0:
        raise ValueError(f"the number of parameters must be positive; got {numel}")
    try:
        chosen = PRECISIONS[precision]
    except KeyError:
        raise ValueError(
            f"precision must be one of {sorted(PRECISIONS)}; got {precision!r}"
        ) from None
    return {stage: numel * bytes_per_param(stage, world_size, chosen) for stage in range(4)}
