"""One fp32 state dict from a sharded checkpoint, built one parameter at a time.

Trainable parameters come from the optimizer shards' fp32 values (exact even when the model
trained in fp16/bf16, and the only copy under stage 3, whose module states hold empty
placeholders for them); buffers and frozen parameters from the module states. Files are
memory-mapped and each parameter is assembled straight into the output, so peak memory stays
near the output's size plus the largest parameter, not several times the model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from zerolap.checkpoint.files import read_checkpoint, read_latest, tag_folder
from zerolap.checkpoint.shards import SavedParams, SegmentIndex

__all__ = ["get_fp32_state_dict"]


def get_fp32_state_dict(
    checkpoint_dir, tag: str | None = None, *, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor]:
    """The model's full state dict in fp32, loadable into the plain model with strict=True
    (without the frozen parameters when ``exclude_frozen_parameters``)."""
    checkpoint_dir = Path(checkpoint_dir)
    tag = tag if tag is not None else read_latest(checkpoint_dir)
    folder = tag_folder(checkpoint_dir, tag)
    saved, shards = read_checkpoint(folder)
    params = SavedParams(saved, SegmentIndex(shards))
    built: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    frozen = set(saved.get("frozen", ())) if exclude_frozen_parameters else set()
    for key, tensor in saved["module"].items():
        if key in frozen:
            continue
        name = saved["aliases"].get(key)
        if name is None:
            out[key] = tensor.float().clone() if tensor.is_floating_point() else tensor.clone()
            continue
        if name not in built:
            built[name] = params.whole_fp32(name)
        out[key] = built[name]
    return out
