"""Reduction operators: the names users pass and what each backend can run.

gloo has no native average, so ``avg`` runs there as a sum divided by the group size once the
sum has arrived. The same table gives the ring algorithm its element-wise combine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as torch_dist

__all__ = ["ReduceOp", "combine_into", "parse_reduce_op"]

ReduceOp = torch_dist.ReduceOp

_BY_NAME = {
    "sum": ReduceOp.SUM,
    "avg": ReduceOp.AVG,
    "mean": ReduceOp.AVG,
    "product": ReduceOp.PRODUCT,
    "prod": ReduceOp.PRODUCT,
    "min": ReduceOp.MIN,
    "max": ReduceOp.MAX,
}
_SUPPORTED = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)


def parse_reduce_op(op: object) -> torch_dist.ReduceOp.RedOpType:
    """``op`` as a ``ReduceOp`` member; accepts the names ``sum avg product min max``."""
    if isinstance(op, str):
        try:
            return _BY_NAME[op.lower()]
        except KeyError:
            raise ValueError(
                f"unknown reduction op {op!r}: expected one of 'sum', 'avg', 'product', 'min', "
                "'max' or a zerolap.comm.ReduceOp"
            ) from None
    if op in _SUPPORTED:
        return op  # type: ignore[return-value]
    raise ValueError(f"unsupported reduction op {op!r}: expected sum, avg, product, min or max")


def native_op(op: torch_dist.ReduceOp.RedOpType, backend: str) -> torch_dist.ReduceOp.RedOpType:
    """The op to hand the backend: gloo runs ``avg`` as ``sum`` (see ``needs_division``)."""
    return ReduceOp.SUM if op == ReduceOp.AVG and backend == "gloo" else op


def needs_division(op: torch_dist.ReduceOp.RedOpType, backend: str) -> bool:
    return op == ReduceOp.AVG and backend == "gloo"


def check_avg_dtype(op: torch_dist.ReduceOp.RedOpType, tensor: torch.Tensor, name: str) -> None:
    if op == ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"op 'avg' needs a floating-point {name}, got dtype {tensor.dtype}")


_COMBINE: dict[object, Callable[[torch.Tensor, torch.Tensor], object]] = {
    ReduceOp.SUM: lambda acc, x: acc.add_(x),
    ReduceOp.AVG: lambda acc, x: acc.add_(x),
    ReduceOp.PRODUCT: lambda acc, x: acc.mul_(x),
    ReduceOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
    ReduceOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
}


def combine_into(op: torch_dist.ReduceOp.RedOpType, acc: torch.Tensor, x: torch.Tensor) -> None:
    """``acc = op(acc, x)`` in place; ``avg`` accumulates a sum (the caller divides once)."""
    _COMBINE[op](acc, x)
