"""Data loading as DeepSpeed does it (``deepspeed.runtime.dataloader``): ``make_loader``, behind
``engine.deepspeed_io`` and ``initialize(training_data=...)``, and ``RepeatingLoader``, a loader
that starts over when it runs out (for training loops that count steps rather than epochs, and
for pipeline engines)."""

from __future__ import annotations

from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from zerolap.accelerator import get_accelerator

__all__ = [
    "ROUTE_ENCODE",
    "ROUTE_EVAL",
    "ROUTE_PREDICT",
    "ROUTE_TRAIN",
    "RepeatingLoader",
    "make_loader",
]

# What a loader is for (DeepSpeed's names): evaluation and prediction read in order.
ROUTE_TRAIN = "train"
ROUTE_EVAL = "eval"
ROUTE_PREDICT = "predict"
ROUTE_ENCODE = "encode"
_ROUTES = (ROUTE_TRAIN, ROUTE_EVAL, ROUTE_PREDICT, ROUTE_ENCODE)


def make_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    replicas: int,
    rank: int,
    route: str = ROUTE_TRAIN,
    drop_last: bool = False,
    data_sampler: Sampler | None = None,
    collate_fn=None,
    pin_memory: bool = False,
    num_workers: int = 0,
) -> DataLoader:
    """Batches of ``batch_size`` from ``rank``'s share of ``dataset`` among ``replicas``: a
    ``DistributedSampler`` (in order for ``ROUTE_EVAL`` and ``ROUTE_PREDICT``, shuffled with its
    seed 0 otherwise)
    unless ``data_sampler`` is given. ``drop_last`` drops a last batch shorter than
    ``batch_size`` (ds_config's ``dataloader_drop_last``)."""
    if route not in _ROUTES:
        raise ValueError(f"route={route!r}: use one of {', '.join(map(repr, _ROUTES))}")
    if data_sampler is None:
        data_sampler = DistributedSampler(
            dataset,
            num_replicas=replicas,
            rank=rank,
            shuffle=route not in (ROUTE_EVAL, ROUTE_PREDICT),
        )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=data_sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        # Pinning is for copies to an accelerator; on a host alone torch warns and pins nothing.
        pin_memory=pin_memory and not get_accelerator().is_synchronized_device(),
        num_workers=num_workers,
    )


class RepeatingLoader:
    def __init__(self, loader) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)  # an empty loader raises StopIteration again
