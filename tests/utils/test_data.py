"""``RepeatingLoader``, ``engine.deepspeed_io`` with ``dataloader_drop_last``, and
``clone_tensors_for_torch_save``."""

from __future__ import annotations

import pytest
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


def check_deepspeed_io(drop_last: bool) -> dict:
    """A dataset of 11 numbered samples over 2 ranks, micro-batches of 2."""
    import zerolap

    data = torch.utils.data.TensorDataset(torch.arange(11.0))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "dataloader_drop_last": drop_last,
    }
    engine, _, loader, _ = zerolap.initialize(
        model=torch.nn.Linear(1, 1), config=config, training_data=data
    )
    assert engine.dataloader_drop_last() is drop_last

    def batches(found):
        return [batch[0].tolist() for batch in found]

    evaluated = engine.deepspeed_io(data, batch_size=4, route="eval")
    with pytest.raises(ValueError, match="route='test'"):
        engine.deepspeed_io(data, route="test")
    with pytest.raises(TypeError, match="map-style dataset"):
        engine.deepspeed_io(iter(range(3)))
    return {
        "train": batches(loader),
        "again": batches(loader),  # the sampler's epoch stays 0 unless set: the same order
        "length": len(loader),
        "eval": batches(evaluated),
    }


@pytest.mark.parametrize("drop_last", [False, True])
def test_deepspeed_io_splits_the_data_and_drops_the_last_short_batch(ranks, drop_last):
    results = ranks(2).run(check_deepspeed_io, drop_last)
    # DistributedSampler pads 11 samples to 12 (6 each); micro-batches of 2 divide 6, batches
    # of 4 leave one of 2, which drop_last drops.
    for rank, result in enumerate(results):
        order = torch.randperm(11, generator=torch.Generator().manual_seed(0)).tolist()
        mine = (order + order[:1])[rank::2]
        assert result["train"] == [mine[i : i + 2] for i in range(0, 6, 2)] == result["again"]
        assert result["length"] == 3
        in_order = ([*range(11), 0])[rank::2]
        expected = [in_order[:4]] if drop_last else [in_order[:4], in_order[4:]]
        assert result["eval"] == [[float(x) for x in b] for b in expected]
    train = sorted(x for result in results for batch in result["train"] for x in batch)
    assert set(train) == set(map(float, range(11)))


def _pad(samples):
    """Pads ragged samples to one length: a plain stack would fail on them."""
    longest = max(len(s) for s in samples)
    return torch.stack([torch.cat([s, s.new_zeros(longest - len(s))]) for s in samples])


class Ragged(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.ones(1 + index % 3)


def check_collate_and_routes() -> dict:
    import zerolap

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {}}}
    engine, *_ = zerolap.initialize(model=torch.nn.Linear(1, 1), config=config, collate_fn=_pad)
    evaluated = [b.shape[0] for b in engine.deepspeed_io(Ragged(), route="eval")]  # padded
    numbered = torch.utils.data.TensorDataset(torch.arange(16.0))
    stacked = torch.utils.data.default_collate  # None would mean initialize's, as in DeepSpeed
    encoded = engine.deepspeed_io(numbered, route="encode", collate_fn=stacked)
    encoded = [b[0].tolist() for b in encoded]
    return {"evaluated": evaluated, "encoded": encoded}


def test_deepspeed_io_collates_with_initializes_collate_fn_and_shuffles_to_encode(ranks):
    for rank, result in enumerate(ranks(2).run(check_collate_and_routes)):
        assert result["evaluated"] == [2, 2]
        order = torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist()[rank::2]
        assert result["encoded"] == [order[i : i + 2] for i in range(0, 8, 2)]  # as DeepSpeed
