"""``UlyssesSPDataLoaderAdapter`` (DeepSpeed's name and arguments): a data loader whose batches
are pieces of sequences.

The S ranks of a sequence-parallel group each draw their own batch from the loader they wrap.
The adapter gathers the S batches on every rank and then yields them one after another, each
cut along the sequence (dim 1): rank r gets tokens r L ... (r+1) L - 1 of every tensor entry,
other entries whole. So one pass over the wrapped loader gives S times its length in
micro-batches, every rank working on the same sequences at once, and the S ranks together
see what S data-parallel ranks would have.

Each batch needs ``input_ids``, ``labels`` and ``position_ids`` (each token's place in its
sequence, which the pieces cannot know otherwise), every tensor entry ``[batch, seq, ...]``
with ``seq`` divisible by S. ``labels`` are replaced by ``shift_labels`` (the label of the
next token, -100 after the last), cut like the rest: a piece's last token predicts the first
token of the next piece, which only the whole sequence knows. Pieces are moved to the CPU, as
DeepSpeed does (the caller moves them where the model is), and made contiguous, which
DeepSpeed's are not on a CPU-only host (transformers' loss then fails on them).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.nn.functional as F

import zerolap.comm as dist
from zerolap.sequence_parallel.exchange import gather_objects, gather_rows

__all__ = ["UlyssesSPDataLoaderAdapter"]


class UlyssesSPDataLoaderAdapter:
    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size: int, device) -> None:
        if (sp_rank, sp_world_size) != (dist.get_rank(sp_group), dist.get_world_size(sp_group)):
            raise ValueError(
                f"UlyssesSPDataLoaderAdapter: sp_rank {sp_rank} of sp_world_size "
                f"{sp_world_size}, but this rank is rank {dist.get_rank(sp_group)} of the "
                f"{dist.get_world_size(sp_group)} in sp_group"
            )
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        return self

    def __next__(self):
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Gather the next batch of every rank of the group and queue this rank's pieces of
        each. At the end of the wrapped loader: start it over and stop this epoch. The ranks
        first agree on what they drew (one small gather, which carries the entries that are
        not tensors as well), so a batch one rank cannot use is the same named error on every
        rank, not a hang or a mismatched collective."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        size, group = self.sp_world_size, self.sp_group
        others = (
            {k: v for k, v in batch.items() if not torch.is_tensor(v)}
            if isinstance(batch, dict)
            else {}
        )
        drawn = gather_objects((_problem(batch, size), _layout(batch), others), group, size)
        for rank, (problem, _, _) in enumerate(drawn):
            if problem is not None:
                raise ValueError(f"sequence parallelism: rank {rank} of the group: {problem}")
        layouts = [layout for _, layout, _ in drawn]
        for rank, layout in enumerate(layouts):
            if _without_length(layout) != _without_length(layouts[0]):
                raise ValueError(
                    "sequence parallelism: the group's ranks drew batches of different entries "
                    f"or shapes (rank 0: {layouts[0]}, rank {rank}: {layout}); every rank's "
                    "batch must have the same entries and batch size"
                )
        lengths = [layout["input_ids"][1] for layout in layouts]
        gathered: list[dict] = [dict(theirs) for _, _, theirs in drawn]
        for key, value in batch.items():
            if torch.is_tensor(value):
                pieces = gather_rows(value.to(self.device), group, size, lengths)
                for whose, piece in zip(gathered, pieces, strict=True):
                    whose[key] = piece
        for whole in gathered:
            self.micro_batches.append(self._piece(whole))

    def _piece(self, batch: dict) -> dict:
        labels = batch.pop("labels")
        batch["shift_labels"] = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
        piece = batch["input_ids"].shape[1] // self.sp_world_size
        start = piece * self.sp_rank
        return {
            # Contiguous: losses view() the labels (DeepSpeed's CPU pieces are views).
            key: value[:, start : start + piece].cpu().contiguous()
            if torch.is_tensor(value)
            else value
            for key, value in batch.items()
        }


def _problem(batch, size: int) -> str | None:
    """What makes this rank's ``batch`` unusable, if anything."""
    if not isinstance(batch, dict):
        return f"a batch must be a dict of named entries, got {type(batch).__name__}"
    for key in ("input_ids", "labels", "position_ids"):
        if key not in batch:
            return (
                f"every batch needs {key!r} (it has {sorted(batch)}); position_ids give each "
                "token its place in the whole sequence (torch.arange(seq) per sample, "
                "restarting at each document when packed)"
            )
    ids = batch["input_ids"]
    if not torch.is_tensor(ids) or ids.dim() < 2:
        return f"input_ids must be a [batch, seq] tensor, got {getattr(ids, 'shape', type(ids))}"
    length = ids.shape[1]
    for key, value in batch.items():
        if torch.is_tensor(value) and (value.dim() < 2 or value.shape[1] != length):
            return (
                f"batch entry {key!r} has shape {tuple(value.shape)}; every tensor entry "
                f"must be [batch, seq={length}, ...] like input_ids"
            )
    if length % size:
        return f"sequences of {length} tokens, not divisible by the {size} ranks"
    return None


def _layout(batch) -> dict:
    """Each entry's shape (tensors) or None (other values)."""
    if not isinstance(batch, dict):
        return {}
    return {k: tuple(v.shape) if torch.is_tensor(v) else None for k, v in batch.items()}


def _without_length(layout: dict) -> dict:
    """A layout with the sequence length taken out (ranks may draw different lengths)."""
    return {k: v if v is None else (v[0], *v[2:]) for k, v in layout.items()}
