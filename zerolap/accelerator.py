"""``get_accelerator()``: DeepSpeed's device abstraction, for CPU and CUDA, on plain torch.

Clients (Accelerate, the Trainer, DeepSpeed's own examples) ask it for the device name, the
communication backend, RNG state, memory statistics, streams and pinned memory instead of
calling ``torch.cuda`` directly, so the same script runs on CPU. One class serves both device
types; a method whose meaning does not exist on CPU (streams, events, caches) does the CPU
equivalent: nothing, or the process's resident memory for memory statistics, as DeepSpeed's
CPU accelerator does.

The device type is CUDA when torch sees a GPU, otherwise CPU; ``DS_ACCELERATOR=cpu`` or
``=cuda`` chooses it explicitly (DeepSpeed's variable).
"""

from __future__ import annotations

import contextlib
import functools
import os

import psutil
import torch

__all__ = ["DeviceAccelerator", "get_accelerator", "runs_apart", "set_accelerator"]

_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


class DeviceAccelerator:
    """DeepSpeed's accelerator interface for one torch device type (``cpu`` or ``cuda``)."""

    def __init__(self, device_type: str) -> None:
        if device_type not in _BACKENDS:
            raise ValueError(f"accelerator must be 'cpu' or 'cuda', got {device_type!r}")
        if device_type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("DS_ACCELERATOR=cuda but torch sees no CUDA device")
        self._name = device_type
        self._communication_backend_name = _BACKENDS[device_type]
        self._cuda = device_type == "cuda"
        self._peak_rss = 0

    # -- what it is -----------------------------------------------------------------------

    def is_synchronized_device(self) -> bool:
        """True on CPU: work is done when the call returns, so no stream waits are needed."""
        return not self._cuda

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.float16]
        return [*dtypes, torch.bfloat16] if self.is_bf16_supported() else dtypes

    def is_triton_supported(self) -> bool:
        return False

    # -- devices ----------------------------------------------------------------------------

    def device_name(self, device_index: int | None = None) -> str:
        if not self._cuda or device_index is None:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: int | None = None):
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        if self._cuda:
            return torch.cuda.current_device()
        return int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    # -- random numbers -----------------------------------------------------------------------

    def random(self):
        return torch.random

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def default_generator(self, device_index: int | None = None) -> torch.Generator:
        if self._cuda:
            index = torch.cuda.current_device() if device_index is None else device_index
            return torch.cuda.default_generators[index]
        return torch.default_generator

    # -- streams and events (CPU: none; work is synchronous) -------------------------------

    @property
    def Stream(self):
        return torch.cuda.Stream if self._cuda else None

    @property
    def Event(self):
        return torch.cuda.Event if self._cuda else None

    def stream(self, stream):
        if self._cuda:
            return torch.cuda.stream(stream)
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None):
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None):
        return torch.cuda.default_stream(device_index) if self._cuda else None

    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback) -> None:
        if self._cuda:
            torch.cuda._lazy_call(callback)
        else:
            callback()

    # -- memory -------------------------------------------------------------------------------
    # On CPU the process's resident memory stands for "allocated", as in DeepSpeed.

    def _rss(self) -> int:
        rss = psutil.Process().memory_info().rss
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else self._rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        self._rss()
        return self._peak_rss

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self._rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_reserved(device_index)
        return self.max_memory_allocated()

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak_rss = 0

    reset_max_memory_allocated = reset_peak_memory_stats
    reset_max_memory_cached = reset_peak_memory_stats

    def memory_stats(self, device_index: int | None = None) -> dict:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        current = self._rss()
        return {
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": self._peak_rss,
        }

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            index = torch.cuda.current_device() if device_index is None else device_index
            return torch.cuda.get_device_properties(index).total_memory
        return psutil.virtual_memory().total

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            free, _ = torch.cuda.mem_get_info(device_index)
            return free
        return psutil.virtual_memory().available

    # -- host memory ----------------------------------------------------------------------------

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """Page-locked copy of ``tensor`` for fast device copies; on CPU the tensor itself."""
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # -- kernels: zerolap builds none ----------------------------------------------------------

    def create_op_builder(self, op_name: str):
        """DeepSpeed's compiled ops; zerolap uses torch's kernels, so there is no builder."""
        return None

    def get_op_builder(self, class_name: str):
        return None

    def __repr__(self) -> str:
        return f"<zerolap accelerator {self._name}, backend {self._communication_backend_name}>"


@functools.cache
def _detected() -> DeviceAccelerator:
    wanted = os.environ.get("DS_ACCELERATOR")
    if wanted is None:
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    return DeviceAccelerator(wanted)


_chosen: DeviceAccelerator | None = None


def get_accelerator() -> DeviceAccelerator:
    """The process's accelerator: CUDA when torch sees a GPU, otherwise CPU (or as
    ``DS_ACCELERATOR`` says)."""
    return _chosen if _chosen is not None else _detected()


def set_accelerator(accelerator: DeviceAccelerator) -> None:
    """Choose the accelerator explicitly (DeepSpeed's ``set_accelerator``)."""
    global _chosen
    _chosen = accelerator


def runs_apart(device: torch.device) -> bool:
    """Whether work on ``device`` runs apart from the host that launches it (a GPU: the host
    queues kernels and goes on). There a step is fastest when the host never waits for the
    device mid-step and does little per parameter, even at the cost of an extra pass over the
    gradients, which such a device makes in a fraction of the host's time; on a CPU the host
    does every pass itself, and such trades lose (``ZeroOptimizer`` and ``GradReducer``'s
    ``in_place`` make them only where this is true)."""
    return device.type != "cpu"
