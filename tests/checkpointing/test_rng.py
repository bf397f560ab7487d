"""The RNG tracker: add, fork, get_states/set_states, reset, and the model-parallel seeds; on the
CPU generator when CUDA is absent."""

from __future__ import annotations

import pytest
import torch

from tests.checkpointing.blocks import fresh_state
from zerolap import checkpointing
from zerolap.checkpointing.rng import MODEL_PARALLEL_RNG, CudaRNGStatesTracker

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the tracker follows the accelerator


def _draw() -> torch.Tensor:
    return torch.rand(4, device=DEVICE)


def _seeded_draws(seed: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.rand(4, generator=generator, device=DEVICE) for _ in range(count)]


class FakeMpu:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def get_model_parallel_rank(self) -> int:
        return self.rank

    def get_model_parallel_world_size(self) -> int:
        return self.world_size

    def get_model_parallel_group(self) -> None:
        return None


def test_fork_draws_from_the_named_state_and_leaves_the_generator_alone():
    tracker = CudaRNGStatesTracker()
    torch.manual_seed(0)
    outside = [_draw() for _ in range(2)]
    torch.manual_seed(0)
    tracker.add("a", 7)
    first = _draw()
    with tracker.fork("a"):
        inside = [_draw(), _draw()]
    with tracker.fork("a"):  # the state advanced
        inside.append(_draw())
    assert torch.equal(first, outside[0]) and torch.equal(_draw(), outside[1])
    for got, want in zip(inside, _seeded_draws(7, 3), strict=True):
        assert torch.equal(got, want)


def test_set_states_returns_to_a_snapshot():
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 7)
    snapshot = tracker.get_states()
    with tracker.fork("a"):
        before = _draw()
    assert not torch.equal(snapshot["a"], tracker.get_states()["a"])
    tracker.set_states(snapshot)
    with tracker.fork("a"):
        assert torch.equal(_draw(), before)


def test_a_seed_or_a_name_added_twice_and_an_unknown_fork_are_errors():
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 7)
    with pytest.raises(ValueError, match="seed 7 is already used"):
        tracker.add("b", 7)
    with pytest.raises(ValueError, match="a state named 'a' already exists"):
        tracker.add("a", 8)
    with pytest.raises(ValueError, match="no state named 'b'"), tracker.fork("b"):
        pass
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.add("a", 7)  # the seed is free again


def test_model_parallel_seed_depends_on_the_mpu_rank():
    with fresh_state():
        for rank in (0, 1):
            checkpointing.configure(FakeMpu(rank, 2))  # partition_activations is off: no group
            checkpointing.model_parallel_cuda_manual_seed(100)
            default = _draw()
            with checkpointing.get_cuda_rng_tracker().fork():
                model_parallel = _draw()
            assert torch.equal(default, _seeded_draws(100, 1)[0])
            assert torch.equal(model_parallel, _seeded_draws(100 + 2718 + rank, 1)[0])
            assert list(checkpointing.get_cuda_rng_tracker().get_states()) == [MODEL_PARALLEL_RNG]


def test_reconfigure_tp_seed_reseeds_only_the_model_parallel_state():
    with fresh_state():
        checkpointing.model_parallel_cuda_manual_seed(100)
        checkpointing.model_parallel_reconfigure_tp_seed(5)
        assert torch.equal(_draw(), _seeded_draws(100, 1)[0])
        with checkpointing.get_cuda_rng_tracker().fork():
            assert torch.equal(_draw(), _seeded_draws(5 + 2718, 1)[0])
