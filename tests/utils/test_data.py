"""``RepeatingLoader`` and ``clone_tensors_for_torch_save``."""

from __future__ import annotations

import torch

from zerolap.checkpoint.utils import clone_tensors_for_torch_save
from zerolap.utils import RepeatingLoader


def test_repeating_loader_starts_over():
    loader = RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]


def test_clone_saves_each_tensor_alone(tmp_path):
    flat = torch.arange(1000.0)
    state = {"a": flat[:2], "nested": [flat[2:4], (flat[4:6], 7)]}
    cloned = clone_tensors_for_torch_save(state)
    torch.save(cloned, tmp_path / "small.pt")
    torch.save(state, tmp_path / "big.pt")
    assert (tmp_path / "small.pt").stat().st_size * 2 < (tmp_path / "big.pt").stat().st_size
    assert torch.equal(cloned["nested"][1][0], flat[4:6]) and cloned["nested"][1][1] == 7
