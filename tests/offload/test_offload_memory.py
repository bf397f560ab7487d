"""What offload to disk takes out of memory, measured in fresh processes: the anonymous resident
set a step adds (after ``initialize``, which builds both runs alike) shrinks by at least 0.9 x
the optimizer state (8 bytes per owned fp32 AdamW element), and the page cache holding the swap
files stays within buffer_count sub-groups."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import pytest
import torch

from tests.multiproc import run_on_ranks

WIDTH, DEPTH = 2048, 2  # 8.4M parameters
SUB_GROUP, BUFFERS = 65_536, 2
# glibc's own settings, measured as a user's process stands (the engine gives the heap's free
# pages back after a swapped step; the run in memory keeps them); and a fixed mmap threshold,
# measured with the heap trimmed for both runs: what each holds.
MALLOC = {"default": ({}, False), "fixed": ({"MALLOC_MMAP_THRESHOLD_": "65536"}, True)}

_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def cached_bytes(path: str) -> int:
    """Bytes of ``path`` in the page cache (mincore over a mapping of the whole file)."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        pages = -(-size // mmap.PAGESIZE)
        vector = (ctypes.c_ubyte * pages)()
        try:
            if _LIBC.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            _LIBC.munmap(address, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vector) * mmap.PAGESIZE


def _anonymous_rss(trim: bool) -> int:
    if trim:
        _LIBC.malloc_trim(0)  # freed heap memory back to the kernel: count what is held
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def measure(directory: str | None, trim: bool) -> dict:
    """``trim``: the heap's free pages are given back before each reading; without it, what a
    user's process holds."""
    import zerolap
    import zerolap.comm as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    zero = {"stage": 2, "sub_group_size": SUB_GROUP, "reduce_bucket_size": 1 << 20}
    if directory is not None:
        zero["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": directory,
            "buffer_count": BUFFERS,
        }
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
    }
    engine, *_ = zerolap.initialize(model=model, config=config)
    _LIBC.malloc_trim(0)  # what initialize left freed does not count against either run
    before = _anonymous_rss(trim)
    cached = []
    for step in range(3):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).square().mean())
        engine.step()
        if directory is not None:
            cached.append(cached_bytes(str(engine.optimizer.tiers[-1].state.file.path)))
    owned = sum(r.end - r.start for r in engine.optimizer.runs)
    # What the next forward sees: reading the parameters waits for the last step's swapped
    # sub-groups, which step in the gathers after step() (offload_optimizer.defer_step).
    torch.stack([p.detach().sum() for p in engine.module.parameters()])
    grown = _anonymous_rss(trim) - before
    dist.barrier()
    return {"grown": grown, "owned": owned, "cached": cached}


@pytest.mark.parametrize("malloc", sorted(MALLOC))
def test_anonymous_rss_drops_by_the_optimizer_state(tmp_path, malloc):
    env, trim = MALLOC[malloc]
    plain = run_on_ranks(measure, 2, None, trim, env=env, timeout=300)
    swapped = run_on_ranks(measure, 2, str(tmp_path), trim, env=env, timeout=300)
    bound = BUFFERS * SUB_GROUP * 8  # two fp32 Adam moments per element
    for rank in range(2):
        state = 8 * plain[rank]["owned"]
        drop = plain[rank]["grown"] - swapped[rank]["grown"]
        assert drop >= 0.9 * state, (rank, drop, state)
        assert max(swapped[rank]["cached"]) <= bound, swapped[rank]["cached"]
