"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``."""

from __future__ import annotations

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item, device: torch.device | str = "cpu"):
    """``item`` (nested dicts, lists and tuples of tensors) with every tensor detached and
    copied to ``device``, so ``torch.save`` writes each tensor's own elements and not the whole
    flat buffer a view shares (zerolap's parameters are views of one flat buffer)."""
    if torch.is_tensor(item):
        return item.detach().to(device=device, copy=True)
    if isinstance(item, dict):
        return type(item)(
            (key, clone_tensors_for_torch_save(value, device)) for key, value in item.items()
        )
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(value, device) for value in item)
    return item
