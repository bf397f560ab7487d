"""The RNG tracker: named generator states that code runs under and comes back from.

Megatron's tensor parallelism draws dropout masks inside model-parallel regions from a state that
differs on each model-parallel rank (``model-parallel-rng``) and elsewhere from the default
generator, which is the same on all of them; ``get_cuda_rng_tracker().fork()`` switches between
the two. DeepSpeed's name says CUDA; the states here are those of the accelerator's default
generator: the current CUDA device's when CUDA is available, else the CPU generator, so CPU-only
runs (and the tests) use the same code.

A state is a tensor from ``get_rng_state()``, which returns a new tensor each time; the tracker
replaces states and never edits one, so a shallow copy of its dict is a snapshot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "MODEL_PARALLEL_RNG",
    "TRACKER",
    "CudaRNGStatesTracker",
    "get_cuda_rng_tracker",
    "manual_seed",
]

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The tracker state ``model_parallel_cuda_manual_seed`` adds and ``fork()`` uses by default."""


def _get_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def manual_seed(seed: int) -> None:
    """Seed the accelerator's default generator (CUDA's current device, else the CPU's)."""
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named states of the accelerator's default generator (Megatron's tracker, DeepSpeed's
    name)."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}  # name -> generator state (DeepSpeed's name)
        self.seeds_: set[int] = set()  # seeds already added; each may be used once

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A snapshot of the states (a new dict)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the states (a ``get_states`` snapshot)."""
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name``, seeded with ``seed``; the generator itself is unchanged."""
        if seed in self.seeds_:
            raise ValueError(f"RNG tracker: seed {seed} is already used")
        if name in self.states_:
            raise ValueError(f"RNG tracker: a state named {name!r} already exists")
        self.seeds_.add(seed)
        outside = _get_rng_state()
        manual_seed(seed)
        self.states_[name] = _get_rng_state()
        _set_rng_state(outside)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with the generator in state ``name``; afterwards ``name`` holds the
        advanced state and the generator is back where it was."""
        if name not in self.states_:
            raise ValueError(f"RNG tracker: no state named {name!r}; add(name, seed) it first")
        outside = _get_rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_rng_state(outside)


TRACKER = CudaRNGStatesTracker()
"""The process's tracker (``get_cuda_rng_tracker()``)."""


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's RNG tracker."""
    return TRACKER
