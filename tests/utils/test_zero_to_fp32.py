"""``deepspeed.utils.zero_to_fp32``'s functions on zerolap checkpoints: the fp32 state dict,
without frozen parameters when asked, written whole or sharded, as torch pickles or safetensors,
and loaded into a plain model."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerolap
import zerolap.comm as dist
from zerolap.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

TIMEOUT = 90.0


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.out = torch.nn.Linear(8, 11, bias=False)
        self.out.weight = self.embed.weight  # tied
        self.register_buffer("count", torch.arange(3.0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.frozen(self.embed(tokens))))


def save_trained(path: str, stage: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerolap.initialize(model=model, config=config)
    tokens = torch.arange(6).reshape(2, 3) + dist.get_rank()
    engine.backward(engine(tokens).sum())
    engine.step()
    engine.save_checkpoint(path)
    state = engine._consolidated_16bit_state_dict()
    return {k: v.clone() for k, v in state.items()} if state is not None else None


@pytest.mark.parametrize("stage", [1, 3])
def test_the_fp32_state_dict_of_a_zerolap_checkpoint(ranks, tmp_path, stage):
    live = ranks(2).run(save_trained, str(tmp_path), stage, timeout=TIMEOUT)[0]
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert set(state) == set(live) and all(torch.equal(state[k], live[k]) for k in live)
    plain = load_state_dict_from_zero_checkpoint(Net(), tmp_path)
    assert torch.equal(plain.frozen.weight, live["frozen.weight"])
    trainable = get_fp32_state_dict_from_zero_checkpoint(tmp_path, exclude_frozen_parameters=True)
    assert set(trainable) == set(live) - {"frozen.weight", "frozen.bias"}


def test_conversion_writes_shards_and_an_index(ranks, tmp_path):
    ranks(2).run(save_trained, str(tmp_path / "ckpt"), 2, timeout=TIMEOUT)
    whole = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "one")
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["pytorch_model.bin"]
    convert_zero_checkpoint_to_fp32_state_dict(
        tmp_path / "ckpt", tmp_path / "split", max_shard_size="400B"
    )
    index = json.loads((tmp_path / "split" / "pytorch_model.bin.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"pytorch_model-00001-of-{len(files):05d}.bin"
    merged = {}
    for name in files:
        merged |= torch.load(tmp_path / "split" / name, weights_only=True)
    assert all(torch.equal(merged[k], whole[k]) for k in whole) and set(merged) == set(whole)
    safetensors = pytest.importorskip("safetensors.torch")
    convert_zero_checkpoint_to_fp32_state_dict(
        tmp_path / "ckpt", tmp_path / "safe", safe_serialization=True, max_shard_size=None
    )
    loaded = safetensors.load_file(tmp_path / "safe" / "model.safetensors")
    assert all(torch.equal(loaded[k], whole[k]) for k in whole)


def test_signatures_are_deepspeeds():
    names = list(inspect.signature(convert_zero_checkpoint_to_fp32_state_dict).parameters)
    assert names == [
        "checkpoint_dir", "output_dir", "max_shard_size", "safe_serialization", "tag",
        "exclude_frozen_parameters",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="max_shard_size"):
        convert_zero_checkpoint_to_fp32_state_dict("x", "y", max_shard_size="lots")


def test_the_command_lists_each_tensor_with_debug(tmp_path):
    # DeepSpeed's script takes -d / --debug; here it lists every tensor written.
    ckpt = Path(__file__).parents[1] / "checkpoint" / "deepspeed_0_19_8" / "s1_ws2" / "ckpt"
    command = [sys.executable, "-m", "zerolap.utils.zero_to_fp32", str(ckpt), str(tmp_path)]
    quiet = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    loud = subprocess.run([*command, "-d"], capture_output=True, text=True, timeout=120, check=True)
    listed = "pytorch_model.bin: fc1.weight (37, 13)"
    assert listed in loud.stderr + loud.stdout
    assert listed not in quiet.stderr + quiet.stdout
    # Not imported before runpy runs it (Python's RuntimeWarning "found in sys.modules").
    assert "RuntimeWarning" not in quiet.stderr, quiet.stderr
