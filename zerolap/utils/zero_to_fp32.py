"""DeepSpeed's ``zero_to_fp32`` functions, on zerolap checkpoints (and DeepSpeed's own).

They are ``zerolap.checkpoint.get_fp32_state_dict`` with DeepSpeed's signatures and output
files: one fp32 state dict, loadable into the plain model, written as ``pytorch_model.bin``
(or ``model.safetensors``), split into ``pytorch_model-00001-of-0000N.bin`` shards with a
``pytorch_model.bin.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``, the Hugging
Face layout) when it exceeds ``max_shard_size``.

Run as a script with DeepSpeed's arguments (``python -m deepspeed.utils.zero_to_fp32
checkpoint_dir output_dir [--safe_serialization] [--max_shard_size 5GB] [-t TAG]
[--exclude_frozen_parameters]``), as is the ``zero_to_fp32.py`` every checkpoint folder holds.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path

import torch

from zerolap.checkpoint.consolidate import get_fp32_state_dict
from zerolap.moe.parallel import global_expert_names
from zerolap.utils.logging import logger

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "main",
]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _parse_size(size: int | str) -> int:
    """``5GB`` -> 5e9 bytes (decimal units; ``GiB`` and the like are binary); ints are bytes."""
    if isinstance(size, int):
        return size
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
    if found is None or found.group(2).upper() not in _UNITS:
        raise ValueError(f"max_shard_size {size!r} is not a size such as 5GB, 500MB or 1GiB")
    return int(float(found.group(1)) * _UNITS[found.group(2).upper()])


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir, tag=None, exclude_frozen_parameters: bool = False, lazy_mode: bool = False
) -> dict[str, torch.Tensor]:
    """The whole model's state dict in fp32 from the checkpoint in ``checkpoint_dir/tag``
    (default: ``latest``). ``lazy_mode`` is accepted for DeepSpeed's signature: the result is
    built one parameter at a time from memory-mapped files either way, and its tensors are
    ordinary tensors (``.contiguous()`` works on them as on DeepSpeed's lazy ones)."""
    return get_fp32_state_dict(
        checkpoint_dir, tag, exclude_frozen_parameters=exclude_frozen_parameters
    )


def _shards(state_dict: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Keys split greedily, in order, into groups of at most ``limit`` bytes (a tensor larger
    than the limit gets a group of its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for key, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    return groups


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir,
    output_dir,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag=None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the fp32 state dict of ``checkpoint_dir/tag`` into ``output_dir``, sharded by
    ``max_shard_size`` (None: one file), as safetensors with ``safe_serialization``."""
    limit = _parse_size(max_shard_size) if max_shard_size is not None else None
    state_dict = get_fp32_state_dict_from_zero_checkpoint(
        checkpoint_dir, tag, exclude_frozen_parameters
    )
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if safe_serialization:
        try:
            from safetensors.torch import save_file
        except ImportError as err:
            raise ImportError("safe_serialization=True needs `pip install safetensors`") from err
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    groups = _shards(state_dict, limit) if limit is not None else [list(state_dict)]
    stem, suffix = weights.rsplit(".", 1)
    weight_map = {}
    for number, keys in enumerate(groups, start=1):
        name = weights if len(groups) == 1 else f"{stem}-{number:05d}-of-{len(groups):05d}.{suffix}"
        # Tied weights are one tensor under several keys; safetensors refuses shared memory.
        shard = {k: state_dict[k].clone() if safe_serialization else state_dict[k] for k in keys}
        if safe_serialization:
            save_file(shard, str(output_dir / name), metadata={"format": "pt"})
        else:
            torch.save(shard, output_dir / name)
        weight_map |= dict.fromkeys(keys, name)
        for key in keys:
            logger.debug(f"{name}: {key} {tuple(state_dict[key].shape)}")
    if len(groups) > 1:
        total = sum(t.numel() * t.element_size() for t in state_dict.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (output_dir / f"{weights}.index.json").write_text(json.dumps(index, indent=2) + "\n")
    logger.info(f"wrote {len(state_dict)} tensors in {len(groups)} file(s) to {output_dir}")


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag=None):
    """Load the checkpoint's fp32 weights into ``model`` (moved to CPU), not strictly, as
    DeepSpeed does; returns ``model``. A model whose experts are spread over ranks takes its
    own experts (the state dict names every expert by its global index)."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    renamed = global_expert_names(model)
    state_dict |= {key: state_dict[name] for key, name in renamed.items() if name in state_dict}
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def main(argv: list[str] | None = None) -> None:
    """DeepSpeed's ``zero_to_fp32.py`` command line."""
    parser = argparse.ArgumentParser(
        description="Write the fp32 state dict of a ZeRO checkpoint (zerolap's or DeepSpeed's)"
    )
    parser.add_argument("checkpoint_dir", help="the folder holding 'latest' and the tag folders")
    parser.add_argument("output_dir", help="where the fp32 state dict files go")
    parser.add_argument("--max_shard_size", default="5GB", help="per file, e.g. 5GB or 500MB")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors")
    parser.add_argument("-t", "--tag", default=None, help="default: the one named in 'latest'")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true", help="list every tensor written")
    args = parser.parse_args(argv)
    if args.debug:
        logger.setLevel(logging.DEBUG)
    convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )


if __name__ == "__main__":
    main()
