"""Expected results shared by the collective and ring tests."""

from __future__ import annotations

import torch


def reductions(values: list[float]) -> dict[str, float]:
    """What each reduction op gives over one value per rank."""
    return {
        "sum": sum(values),
        "avg": sum(values) / len(values),
        "product": float(torch.tensor(values, dtype=torch.float64).prod()),
        "min": min(values),
        "max": max(values),
    }
