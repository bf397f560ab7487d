"""The first-call check that every rank of a tensor group got the same inputs.

Tensor-parallel ranks compute one model copy together, so they must be fed the same inputs; a
data loader sharded over every rank instead of over the data-parallel ranks trains on garbage
without any error, and ``generate`` arguments that differ (``max_new_tokens``, ``do_sample``)
leave one rank waiting in an all-reduce the others never start. At the first call each rank
reduces its inputs to a small fingerprint (per tensor: shape, dtype, and two position-weighted
sums in float64; per plain setting, a checksum of its value) and the tensor group all-gathers
them: two tiny collectives, once, instead of pickling the batch.
"""

from __future__ import annotations

import zlib

import torch
from torch.utils._pytree import tree_flatten

import zerolap.comm as dist

__all__ = ["check_same_inputs", "fingerprint"]


def fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A float64 vector that differs, with overwhelming probability, when any tensor differs in
    shape, dtype or value. The weights are a function of position only, so every rank uses the
    same ones."""
    rows = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64).remainder_(9973).add_(1)
        shape = torch.tensor(list(tensor.shape) + [-1] * (8 - tensor.dim()), dtype=torch.float64)
        rows.append(
            torch.cat(
                [
                    shape[:8],
                    torch.tensor(
                        [float(zlib.crc32(str(tensor.dtype).encode()))], dtype=torch.float64
                    ),
                    flat.sum().reshape(1),
                    (flat * weights).sum().reshape(1),
                ]
            )
        )
    return torch.cat(rows) if rows else torch.zeros(1, dtype=torch.float64)


_PLAIN = (bool, int, float, str, type(None))


def _settings(leaves: list) -> torch.Tensor:
    """A checksum per plain value among ``leaves`` (numbers, flags, strings; an object's
    ``to_dict()``, as a ``GenerationConfig`` has, counts by its plain values). Other objects
    are left out, since their text may hold a memory address, and so is None, which stands
    for an object on some ranks (a ``streamer`` given to rank 0 only)."""
    values = []
    for leaf in leaves:
        if leaf is None:
            continue
        if isinstance(leaf, _PLAIN):
            values.append(leaf)
        elif callable(getattr(leaf, "to_dict", None)):
            inner, _ = tree_flatten(leaf.to_dict())
            values += [v for v in inner if v is not None and isinstance(v, _PLAIN)]
    return torch.tensor(
        [float(zlib.crc32(repr(value).encode())) for value in values], dtype=torch.float64
    )


def check_same_inputs(
    group, inputs: tuple, kwargs: dict, *, call: str = "forward", advice: str
) -> None:
    """Raise naming the ranks of the tensor group ``group`` whose inputs (tensors and plain
    settings) differ from its first rank's, at the first ``call``; ``advice`` says what to do
    about it. Called once, by every rank of the group."""
    leaves, _ = tree_flatten((inputs, dict(sorted(kwargs.items()))))  # in any keyword order
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    mine = torch.cat([fingerprint(tensors), _settings(leaves)]).to(dist.buffer_device(group))
    size = torch.tensor([mine.numel()], dtype=torch.float64, device=mine.device)
    sizes = dist.all_gather(size, group=group)
    if any(int(s.item()) != mine.numel() for s in sizes):
        counts = [int(s.item()) for s in sizes]
        what = "a different number or kind of inputs"
        raise ValueError(_message(group, what, counts, call, advice))
    prints = dist.all_gather(mine, group=group)
    differ = [t for t, p in enumerate(prints) if not torch.equal(p, prints[0])]
    if differ:
        raise ValueError(_message(group, "different inputs", differ, call, advice))


def _message(group, what: str, detail, call: str, advice: str) -> str:
    ranks = dist.get_all_ranks_from_group(group)
    return (
        f"tensor parallelism: the ranks of tensor group {ranks} got {what} at the first "
        f"{call} ({detail}); the ranks of a tensor group compute one model copy and must be "
        f"given the same inputs: {advice}"
    )
