"""``get_accelerator()`` on CPU: what Accelerate, the Trainer and DeepSpeed's examples ask it."""

from __future__ import annotations

import pytest
import torch

from zerolap.accelerator import DeviceAccelerator, get_accelerator


def test_cpu_answers():
    accelerator = get_accelerator()
    assert accelerator.device_name() == "cpu" and accelerator.current_device_name() == "cpu"
    assert accelerator.communication_backend_name() == "gloo"
    assert accelerator.device(0) == torch.device("cpu") and accelerator.device_count() == 1
    assert accelerator.is_available() and accelerator.is_synchronized_device()
    assert torch.bfloat16 in accelerator.supported_dtypes()
    accelerator.synchronize()
    accelerator.empty_cache()
    with accelerator.stream(None):
        pass
    assert accelerator.Stream is None and accelerator.current_stream() is None


def test_rng_state_round_trip():
    accelerator = get_accelerator()
    accelerator.manual_seed(3)
    state = accelerator.get_rng_state()
    first = torch.rand(4)
    accelerator.set_rng_state(state)
    assert torch.equal(torch.rand(4), first)
    assert accelerator.initial_seed() == 3


def test_memory_figures_are_the_processes():
    accelerator = get_accelerator()
    accelerator.reset_peak_memory_stats()
    allocated = accelerator.memory_allocated()
    assert 0 < allocated <= accelerator.max_memory_allocated() <= accelerator.total_memory()
    assert accelerator.memory_stats()["allocated_bytes.all.current"] > 0


def test_an_unknown_or_missing_device_is_refused():
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        DeviceAccelerator("xpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            DeviceAccelerator("cuda")
