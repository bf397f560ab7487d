"""The batch-size triangle: ``train_batch_size = micro_batch * gradient_accumulation_steps *
world_size``, resolved from whichever of the three a ds_config gives, as DeepSpeed does.

``world_size`` is the data-parallel world size (the number of ranks that each see a different
micro-batch). Two values given derive the third; only ``train_batch_size`` gives one step of
accumulation; only the micro-batch does too. A derivation that does not divide exactly is an
error (DeepSpeed floors and then fails its consistency check), and every error shows all four
numbers.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["BatchSize", "resolve_batch_size"]

_TRAIN = "train_batch_size"
_MICRO = "train_micro_batch_size_per_gpu"
_ACCUMULATION = "gradient_accumulation_steps"


class BatchSize(NamedTuple):
    """The three batch-size values, all known."""

    train_batch_size: int
    """Samples per optimizer step, over all ranks."""
    train_micro_batch_size_per_gpu: int
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: int
    """Micro-batches accumulated before each optimizer step."""


def resolve_batch_size(
    *,
    train_batch_size: int | None,
    train_micro_batch_size_per_gpu: int | None,
    gradient_accumulation_steps: int | None,
    world_size: int,
) -> BatchSize:
    """Fill in the missing values of the triangle; raises ``ValueError`` naming the numbers when
    the values given are inconsistent or the missing one would not be a whole number."""
    train, micro, steps = (
        train_batch_size,
        train_micro_batch_size_per_gpu,
        gradient_accumulation_steps,
    )
    given = {_TRAIN: train, _MICRO: micro, _ACCUMULATION: steps, "world_size": world_size}
    for name, value in given.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1; got {value}")
    if train is None and micro is None:
        raise ValueError(
            f"give {_TRAIN} or {_MICRO} (or both); {_ACCUMULATION} alone cannot set the batch size"
        )
    if train is None:
        steps = 1 if steps is None else steps
        train = micro * steps * world_size
    elif micro is None:
        steps = 1 if steps is None else steps
        micro = _derive(_MICRO, train, f"{_ACCUMULATION}={steps}", steps, world_size)
    elif steps is None:
        steps = _derive(_ACCUMULATION, train, f"{_MICRO}={micro}", micro, world_size)
    if train != micro * steps * world_size:
        raise ValueError(
            f"{_TRAIN}={train} must equal {_MICRO}={micro} × {_ACCUMULATION}={steps} × "
            f"world_size={world_size} (= {micro * steps * world_size})"
        )
    return BatchSize(train, micro, steps)


def _derive(name: str, train: int, other: str, other_value: int, world_size: int) -> int:
    """``train / (other_value * world_size)``, which must be a whole number."""
    divisor = other_value * world_size
    if train % divisor:
        raise ValueError(
            f"cannot derive {name}: {_TRAIN}={train} is not divisible by "
            f"{other} × world_size={world_size} (= {divisor})"
        )
    return train // divisor
