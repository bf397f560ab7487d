"""``RepeatingLoader``: a data loader that starts over when it runs out (DeepSpeed's, used by
training loops that count steps rather than epochs, and by pipeline engines)."""

from __future__ import annotations

__all__ = ["RepeatingLoader"]


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
