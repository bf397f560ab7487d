"""``deepspeed.runtime.utils`` helpers: seeding every generator, moving nested tensors, the memory
report."""

from __future__ import annotations

import random

import numpy
import torch

from tests.logs import captured_logs
from zerolap.runtime.utils import move_to_device, see_memory_usage, set_random_seed


def _draws() -> tuple:
    return random.random(), numpy.random.rand(), torch.rand(()).item()


def test_set_random_seed_seeds_python_numpy_and_torch():
    set_random_seed(1234)
    first = _draws()
    set_random_seed(1234)
    assert _draws() == first
    set_random_seed(2**40 + 1234)  # larger than NumPy's 32-bit seeds: reduced, not refused
    assert _draws() != first


def test_move_to_device_moves_nested_tensors_and_picked_ones_in_place():
    tensor = torch.ones(2, dtype=torch.float32)
    moved = move_to_device({"a": [tensor, (tensor,)], "b": tensor}, torch.device("meta"))
    assert moved["a"][0].is_meta and moved["a"][1][0].is_meta and moved["b"].is_meta
    assert isinstance(moved["a"][1], tuple) and not tensor.is_meta  # rebuilt, not changed

    picked = torch.ones(2)
    (same,) = move_to_device([picked], torch.float64, criterion_func=torch.is_tensor)
    assert same is picked and picked.dtype == torch.float64  # moved in place


def test_see_memory_usage_reports_only_when_forced_and_resets_the_peak():
    from zerolap.accelerator import get_accelerator

    with captured_logs() as logs:
        see_memory_usage("not forced")
    assert logs == []
    # 64 MiB, touched, where MA counts it (the GPU on a CUDA host, else the resident set)
    held = torch.ones(64 << 20, dtype=torch.uint8, device=get_accelerator().device())
    with captured_logs() as logs:
        see_memory_usage("after the buffer", force=True)
    assert logs[0] == "INFO: after the buffer"
    fields = logs[1].removeprefix("INFO: ").split()
    assert fields[0::3] == ["MA", "Max_MA", "CA", "Max_CA"] and set(fields[2::3]) == {"GB"}
    assert float(fields[1]) >= held.numel() / 2**30 - 0.005  # the buffer is in what is resident
    assert logs[2].startswith("INFO: CPU Virtual Memory: used = ") and logs[2].endswith("%")
    del held
    # the peak was reset by the report: the next one starts from what is resident now
    assert get_accelerator().max_memory_allocated() <= get_accelerator().memory_allocated() + (
        8 << 20
    )
