"""Launcher discovery (pure) and init_distributed under each launcher (real processes)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as torch_dist

import zerolap
import zerolap.comm as dist
from tests.multiproc import RankFailure, run_on_ranks
from zerolap.comm.checks import check_group
from zerolap.comm.env import discover_launch_env, first_slurm_host


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("node7", "node7"), ("gpu-[003-005,9],cpu1", "gpu-003"), ("a[1,2]", "a1"), ("x,y", "x")],
)
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_discovery_precedence_and_values():
    torchrun = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "h0",
        "MASTER_PORT": "1234",
    }
    slurm = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "6",
        "SLURM_LOCALID": "2",
        "SLURM_JOB_NODELIST": "n[10-12]",
    }
    mpi = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    env = discover_launch_env(torchrun | slurm | mpi)
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("torchrun", 3, 8, 1)
    assert (env.master_addr, env.master_port) == ("h0", 1234)
    env = discover_launch_env(slurm | mpi, distributed_port=4000)
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("slurm", 5, 6, 2)
    assert (env.master_addr, env.master_port) == ("n10", 4000)
    env = discover_launch_env(mpi)
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("mpi", 1, 2, 1)
    assert discover_launch_env({}).launcher == "single"
    assert discover_launch_env({}).world_size == 1
    env = discover_launch_env(torchrun, rank=0, world_size=2)
    assert (env.launcher, env.rank, env.world_size) == ("explicit", 0, 2)


def test_discovery_errors_name_the_variable():
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        discover_launch_env({"RANK": "x", "WORLD_SIZE": "2"})
    multi_node = {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    with pytest.raises(ValueError, match="set MASTER_ADDR"):
        discover_launch_env(multi_node)


def init_from_env_and_reduce():
    zerolap.init_distributed(timeout=30, verbose=False)
    dist.init_distributed(verbose=False)  # a second call is harmless
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), dist.get_local_rank(), t.item()


LAUNCHERS = {
    "torchrun": lambda r, port: {
        "RANK": str(r),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": str(r),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    },
    "slurm": lambda r, port: {
        "SLURM_PROCID": str(r),
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": str(r),
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "MASTER_PORT": str(port),
    },
    "mpi": lambda r, port: {
        "OMPI_COMM_WORLD_RANK": str(r),
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_PORT": str(port),
    },
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_init_distributed_under_launcher(launcher):
    results = run_on_ranks(init_from_env_and_reduce, 2, env=LAUNCHERS[launcher], init=False)
    assert results == [(0, 2, 0, 1.0), (1, 2, 1, 1.0)]


def single_process_without_launcher():
    start = time.monotonic()
    dist.init_distributed(verbose=False)
    t = torch.ones(4)
    dist.all_reduce(t, op="avg")
    assert dist.ring_all_reduce(torch.ones(3)).tolist() == [1.0] * 3
    assert torch.equal(t, torch.ones(4)) and dist.get_world_size() == 1
    return time.monotonic() - start


def test_no_launcher_means_a_job_of_one():
    (elapsed,) = run_on_ranks(single_process_without_launcher, 1, init=False, timeout=60)
    assert elapsed < 10


def nccl_without_a_gpu():
    with pytest.raises(RuntimeError, match=r"dist_backend='nccl'.* sees none.*'gloo'"):
        dist.init_distributed(dist_backend="nccl", verbose=False)
    return torch_dist.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for hosts without a GPU")
def test_nccl_on_a_host_without_gpu_is_a_named_error():
    assert run_on_ranks(nccl_without_a_gpu, 1, init=False, timeout=60) == [False]


def _rank_port_env(rank: int, port: int) -> dict:
    return {"ZL_RANK": str(rank), "ZL_PORT": str(port)}


def _join_two_ranks(timeout: float) -> None:
    """Join the 2-rank job described by ``_rank_port_env``."""
    dist.init_distributed(
        verbose=False,
        timeout=timeout,
        rank=int(os.environ["ZL_RANK"]),
        world_size=2,
        init_method=f"tcp://127.0.0.1:{os.environ['ZL_PORT']}",
    )


def regroup_through_torch():
    """Two ranks, then torch's own destroy (as Accelerate's ``end_training`` does) and a new
    group of each rank alone: zerolap's ops must see the new group, not the facts of the old."""
    _join_two_ranks(timeout=30)
    dist.ring_all_reduce(torch.ones(3))  # the default group's facts are looked up and kept
    torch_dist.destroy_process_group()
    torch_dist.init_process_group("gloo", store=torch_dist.HashStore(), rank=0, world_size=1)
    alone = dist.ring_all_reduce(torch.full((3,), 2.0)).tolist()
    size = check_group("test", None).size
    torch_dist.destroy_process_group()
    return alone, size


def test_ops_after_torchs_own_destroy_see_the_new_group():
    # Before, the ring all-reduce used the old group's size (2) in a group of one.
    assert (
        run_on_ranks(regroup_through_torch, 2, env=_rank_port_env, init=False)
        == [([2.0] * 3, 1)] * 2
    )


def adopt_existing_group():
    """The user made the process group; init_distributed adopts it as it is."""
    torch_dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['ZL_PORT']}",
        rank=int(os.environ["ZL_RANK"]),
        world_size=2,
    )
    dist.init_distributed(verbose=False)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_wraps_a_user_created_group():
    assert run_on_ranks(adopt_existing_group, 2, env=_rank_port_env, init=False) == [2.0, 2.0]


def crash_one_rank():
    _join_two_ranks(timeout=20)
    if dist.get_rank() == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1 << 16))
    except dist.CommError as err:
        return str(err), time.monotonic() - start
    raise AssertionError("all_reduce with a dead peer did not fail")


def test_crashed_rank_makes_the_others_fail_not_hang():
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(crash_one_rank, 2, env=_rank_port_env, init=False, timeout=60)
    assert "rank 1 exited with code 3" in str(failure.value)
    ok, (message, elapsed) = failure.value.answers[0]
    assert ok and "rank 0 waited for all_reduce on group ranks [0, 1] (gloo)" in message
    assert elapsed < 20  # the peer's death is noticed, well before the 20 s group timeout


def wait_for_absent_peer():
    _join_two_ranks(timeout=3)
    if dist.get_rank() == 1:
        time.sleep(8)  # alive but never joins the collective
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except dist.CommError as err:
        return str(err), time.monotonic() - start
    raise AssertionError("all_reduce without its peer did not time out")


def test_timeout_error_names_the_waiting_rank():
    (message, elapsed), _ = run_on_ranks(
        wait_for_absent_peer, 2, env=_rank_port_env, init=False, timeout=60
    )
    assert "rank 0 waited for all_reduce on group ranks [0, 1] (gloo)" in message
    assert elapsed < 8
