"""ZeRO-Offload: optimizer state and stage-3 parameter shards kept off the accelerator, in host
memory (``device: cpu``) or in swap files on disk (``device: nvme``).

* ``swap_file``: how it talks to the disk (preallocated files, aligned direct or buffered I/O,
  checksums).
* ``optimizer_swap``: swapped sub-groups of optimizer state streamed through a few buffers, one
  I/O lane each.
* ``swapped_runs``: the optimizer's swapped tier, which steps them one sub-group at a time.
* ``host``: on an accelerator, the optimizer's offloaded runs stepped in host memory, their
  gradients copied down during backward and their parameters copied back up.
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
from zerolap.offload.host import HostPlan
from zerolap.offload.param_swap import ParamSwapPlan
from zerolap.offload.swapped_runs import SwapPlan

__all__ = ["HostPlan", "OffloadPlan", "apart_from_host", "plan_offload"]


@dataclass
class OffloadPlan:
    optimizer: SwapPlan | None = None  # offload_optimizer: nvme
    host: HostPlan | None = None  # offload_optimizer on an accelerator: the step on the host
    param_host: HostPlan | None = None  # offload_param cpu on an accelerator: stage 3's shard
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


def apart_from_host(device: torch.device) -> bool:
    """Whether host memory is apart from where training runs (an accelerator), so that
    offloaded state must be copied in between. On a CPU-only host it is not: the state already
    is in host memory. (Tests make it true on CPU to run the accelerator's data path there, its
    copies then being host-to-host.)"""
    return device.type != "cpu"


def _plan_optimizer(plan: OffloadPlan, zero: ZeroConfig, device: torch.device, rank: int) -> None:
    opt, key = zero.offload_optimizer, "zero_optimization.offload_optimizer"
    if opt is None or not opt.enabled:
        return
    if apart_from_host(device):
        pin = opt.pin_memory and device.type == "cuda"  # page-locked memory is CUDA's
        plan.host = HostPlan(device=device, ratio=opt.ratio, pin=pin)
        if opt.device == "cpu":
            plan.notes.append(
                f"{key}.device 'cpu': at least {opt.ratio:.0%} of the optimizer's elements, in "
                f"whole sub-groups of {zero.sub_group_size}, have their fp32 master, state and "
                "step in "
                f"host memory{' (pinned)' if plan.host.pin else ''}; their gradients are "
                "copied to the host during backward and their parameters back after each step"
            )
            return
    elif opt.device == "cpu":
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
        pin=plan.host is not None and plan.host.pin,
    )
    plan.notes.append(
        f"{key}.device 'nvme': {opt.ratio:.0%} of the optimizer state (and of the fp32 master "
        f"values, where the optimizer keeps them) in swap files under {directory}, through "
        f"{opt.buffer_count} buffers of sub_group_size {zero.sub_group_size} elements"
    )


def _plan_params(plan: OffloadPlan, zero: ZeroConfig, device: torch.device, rank: int) -> None:
    prm, key = zero.offload_param, "zero_optimization.offload_param"
    if prm is None or not prm.enabled:
        return
    if prm.device == "cpu" and apart_from_host(device):
        pin = prm.pin_memory and device.type == "cuda"
        plan.param_host = HostPlan(device=device, ratio=1.0, pin=pin)
        plan.notes.append(
            f"{key}.device 'cpu': this rank's shard of the parameters lives in host memory"
            f"{' (pinned)' if pin else ''}; each gather copies its chunk up first, and the step "
            "writes the updated chunk back down"
        )
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
