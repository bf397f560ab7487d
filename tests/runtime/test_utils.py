"""``deepspeed.runtime.utils`` helpers: seeding every generator, moving nested tensors."""

from __future__ import annotations

import random

import numpy
import torch

from zerolap.runtime.utils import move_to_device, set_random_seed


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
