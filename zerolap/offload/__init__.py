"""ZeRO-Offload: optimizer state and stage-3 parameter shards kept off the accelerator, in host
memory (``device: cpu``) or in swap files on disk (``device: nvme``).

* ``swap_file``: how it talks to the disk (preallocated files, aligned direct or buffered I/O,
  checksums).
* ``optimizer_swap``: swapped sub-groups of optimizer state streamed through a few buffers, one
  I/O lane each.
* ``swapped_runs``: the optimizer's swapped tier, which steps them one sub-group at a time.
* ``param_swap``: stage 3's parameter chunks on disk, cached in a few buffers.

``plan_offload`` reads the two ds_config blocks once, checks what they ask of this machine, and
says what will happen (``OffloadPlan.notes``); the engine hands its parts to the components.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerolap.config import ConfigError
from zerolap.config.zero import ZeroConfig
from zerolap.offload.param_swap import ParamSwapPlan
from zerolap.offload.swapped_runs import SwapPlan

__all__ = ["OffloadPlan", "plan_offload"]


@dataclass
class OffloadPlan:
    optimizer: SwapPlan | None = None  # offload_optimizer: nvme
    params: ParamSwapPlan | None = None  # offload_param: nvme (stage 3)
    notes: list[str] = field(default_factory=list)  # what the blocks do here, logged once


def _directory(path: str, key: str) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"{key}: {directory} is not an existing directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {directory} is not writable")
    return directory


def plan_offload(zero: ZeroConfig, *, device: torch.device, rank: int) -> OffloadPlan:
    """What ``offload_optimizer`` / ``offload_param`` do for an engine on ``device`` (blocks at
    a stage that cannot use them were named by the config's advice, and do nothing)."""
    plan = OffloadPlan()
    if zero.stage > 0:
        _plan_optimizer(plan, zero, device, rank)
    if zero.stage == 3:
        _plan_params(plan, zero, device, rank)
    return plan


def _on_host(block, key: str, device: torch.device) -> bool:
    """Whether ``block`` offloads anything; offload from an accelerator is not built yet."""
    if block is None or not block.enabled:
        return False
    if device.type != "cpu":
        raise NotImplementedError(
            f"{key}.device={block.device!r} on {device.type}: zerolap offloads from CPU-only "
            "hosts so far (the host side of accelerator offload is not implemented)"
        )
    return True


def _plan_optimizer(plan: OffloadPlan, zero: ZeroConfig, device: torch.device, rank: int) -> None:
    opt, key = zero.offload_optimizer, "zero_optimization.offload_optimizer"
    if not _on_host(opt, key, device):
        return
    if opt.device == "cpu":
        plan.notes.append(
            f"{key}.device 'cpu': the optimizer state and step already live in host memory on "
            "this CPU-only host; nothing moves (pin_memory needs an accelerator)"
        )
        return
    directory = _directory(opt.nvme_path, f"{key}.nvme_path")
    plan.optimizer = SwapPlan(
        directory=directory,
        rank=rank,
        ratio=opt.ratio,
        buffer_count=opt.buffer_count,
        pipeline_read=opt.pipeline_read,
        pipeline_write=opt.pipeline_write,
        pin=False,  # nothing to copy to an accelerator from
    )
    plan.notes.append(
        f"{key}.device 'nvme': {opt.ratio:.0%} of the optimizer state (and of the fp32 master "
        f"values, where the optimizer keeps them) in swap files under {directory}, through "
        f"{opt.buffer_count} buffers of sub_group_size {zero.sub_group_size} elements"
    )


def _plan_params(plan: OffloadPlan, zero: ZeroConfig, device: torch.device, rank: int) -> None:
    prm, key = zero.offload_param, "zero_optimization.offload_param"
    if not _on_host(prm, key, device):
        return
    if prm.device == "cpu":
        plan.notes.append(
            f"{key}.device 'cpu': parameter shards already live in host memory on this "
            "CPU-only host; nothing moves"
        )
        return
    directory = _directory(prm.nvme_path, f"{key}.nvme_path")
    plan.params = ParamSwapPlan(
        directory=directory,
        rank=rank,
        buffer_count=prm.buffer_count,
        buffer_size=prm.buffer_size,
        max_in_cpu=prm.max_in_cpu,
    )
    plan.notes.append(
        f"{key}.device 'nvme': parameter shards past the first {prm.max_in_cpu:,} elements per "
        f"rank (max_in_cpu) in swap files under {directory}, through {prm.buffer_count} "
        f"buffers of up to {prm.buffer_size:,} elements; the optimizer keeps an fp32 master "
        "(on disk too with offload_optimizer nvme)"
    )
