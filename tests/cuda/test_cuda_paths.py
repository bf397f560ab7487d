"""What runs only on a CUDA device, checked for values where there is one (skipped elsewhere; on
a lent GPU, ``bash benchmarks/gpu_check.sh`` runs these first).

The lent machines have one GPU, so ZeRO and offload run at world size 1 on NCCL: its stream
for every collective, the side stream that copies reduced gradients down to pinned host memory,
the events that gate the reused buffers, and ``non_blocking`` copies back up. Tensor
parallelism needs two ranks: they share the GPU over gloo, which takes CUDA tensors for its
all-reduces and orders them on CUDA streams (as NCCL does), so the backward overlap's
all-reduce, started before the weight gradient and waited after it, runs on the device.
The checks themselves are the CPU suite's (``tests.zero.test_parity``,
``tests.offload.test_host_offload``, ``tests.tensor_parallel.test_layers``), given the device.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import RankFailure, run_on_ranks
from tests.offload.test_host_offload import check_host_step, resume, save_and_continue
from tests.offload.test_offload_states import check_all_parked, device_memory_parked
from tests.offload.test_offload_training import _close
from tests.tensor_parallel.test_layers import check_fused_gpt_attention
from tests.zero.test_device_step import check_same_skip, train
from tests.zero.test_parity import check_parity

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _joined(backend: str, fn, *args):
    import zerolap.comm as dist

    dist.init_distributed(dist_backend=backend, verbose=False)
    return fn(*args)


def on_gpu(fn, *args, world: int = 1, backend: str = "nccl", timeout: float = 45.0) -> list:
    """``fn(*args)`` on ``world`` fresh processes, every one on GPU 0, joined by ``backend``."""

    def env(rank: int, port: int) -> dict[str, str]:
        return {
            "DS_ACCELERATOR": "cuda",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
        }

    return run_on_ranks(_joined, world, backend, fn, *args, env=env, init=False, timeout=timeout)


def _math_attention(fn, *args):
    """``fn(*args)`` with attention computed by the plain math kernel, as on the CPU: the fused
    kernels pick their algorithm by head count, which the dense model (all heads) and each TP
    rank (half of them) do not share."""
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    return fn(*args)


def test_tensor_parallel_backward_overlap_on_the_gpu():
    """TP 2 on one GPU: the demo GPT equals the dense one, and overlapping the backward
    all-reduces changes no bit of any gradient; the full overlap (lanes on threads) is refused
    there."""
    check = (_math_attention, check_fused_gpt_attention)
    results = {
        overlap: on_gpu(*check, overlap, 5, "cuda", world=2, backend="gloo")
        for overlap in ("off", "backward")
    }
    for rank, (off, on) in enumerate(zip(results["off"], results["backward"], strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(off, on, strict=True)), f"rank {rank}"
    with pytest.raises(RankFailure, match="runs on cuda"):
        on_gpu(*check, "full", 5, "cuda", world=2, backend="gloo")


def test_stages_equal_one_process_on_the_gpu():
    """Stages 0-3, overlap on and off, accumulation and clipping, against plain PyTorch on the
    same GPU."""
    failures = on_gpu(check_parity)[0]
    assert failures == [], "\n".join(failures)


@pytest.mark.parametrize("stage", [0, 2])
def test_the_gpu_skips_a_non_finite_step_itself(stage):
    """The global norm, clipping and the skip of a NaN loss's step decided on the GPU (fused
    AdamW's ``found_inf``, the flag read once through a pinned copy behind an event), against
    the same run taking those decisions on the host; both stages with gradients accumulated
    in place (fp32 at world size 1 divides by nothing on the way)."""
    dev = on_gpu(train, stage, True, 2, 1.0, 0)[0]
    host = on_gpu(train, stage, False, 2, 1.0, 0)[0]
    check_same_skip(dev, host, 0)


def test_host_step_equals_the_device_step(tmp_path):
    """``offload_optimizer`` / ``offload_param`` on cpu and nvme from the GPU, at stages 1-3
    in fp32, bf16 and fp16, against the same runs stepped on the GPU; nothing of the offloaded
    state left on it."""
    failures = on_gpu(check_host_step, str(tmp_path), False, timeout=95)[0]
    assert failures == [], "\n".join(failures)


def test_checkpoint_from_the_gpu_resumes_on_it_and_on_a_cpu(tmp_path):
    """Saved by a stage-2 run stepping on the host (two steps, then a third for reference):
    resumed on the GPU without offload, and in a process with no GPU at stage 3, the third
    step lands where the saving run's did (within the two devices' rounding)."""
    ckpt = str(tmp_path / "ckpt")
    want = on_gpu(save_and_continue, ckpt, True)[0]
    assert _close(on_gpu(resume, ckpt, 2, False)[0], want) < 1e-5
    no_gpu = {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    cpu = run_on_ranks(resume, 1, ckpt, 3, False, env=no_gpu, timeout=45)
    assert _close(cpu[0], want) < 1e-4


def test_offload_states_frees_the_gpu_and_comes_back():
    """``offload_states()`` at every stage on the GPU: the states leave the device (its
    allocator's count drops by at least the model state the engine counts), the engine
    refuses what needs them, and after ``reload_states()`` training goes on bit for bit."""
    assert on_gpu(check_all_parked, timeout=95)[0] == []
    memory = on_gpu(device_memory_parked, timeout=45)[0]
    assert memory["freed"] >= memory["model state"] + memory["buckets"] > 0, memory
    assert memory["model state"] <= memory["taken back"] <= memory["freed"], memory
