"""Checkpoints as DeepSpeed's clients call them: ``save_checkpoint(...,
exclude_frozen_parameters=)`` (the Trainer looks for it in the signature, for PEFT models),
``load_checkpoint`` in DeepSpeed's positional order with ``load_module_strict`` and
``custom_load_fn``, and the consolidated 16-bit state dicts."""

from __future__ import annotations

import inspect

import pytest
import torch

import zerolap
import zerolap.comm as dist
from zerolap.checkpoint import CheckpointError
from zerolap.zero import GatheredParameters

TIMEOUT = 90.0


class Adapted(torch.nn.Module):
    """A frozen base with a small trainable adapter (what PEFT builds), and a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.base = torch.nn.Linear(8, 8)
        self.adapter = torch.nn.Linear(8, 8, bias=False)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight
        self.embed.requires_grad_(False)
        self.base.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(torch.tanh(self.base(h) + self.adapter(h)))


def _engine(stage: int, seed: int = 0):
    torch.manual_seed(seed)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    model = Adapted()
    engine, *_ = zerolap.initialize(model=model, config=config)
    return engine, model


def _train(engine) -> None:
    tokens = torch.arange(6).reshape(2, 3) + dist.get_rank()
    engine.backward(engine(tokens).float().pow(2).mean())
    engine.step()


def _values(model) -> dict:
    named = list(model.named_parameters())
    with GatheredParameters([p for _, p in named]):
        return {n: p.detach().clone() for n, p in named}


def check_exclude_frozen(path: str, stage: int) -> dict:
    engine, model = _engine(stage)
    _train(engine)
    trained = _values(model)
    engine.save_checkpoint(path, "t", None, True, exclude_frozen_parameters=True)
    fresh, fresh_model = _engine(stage, seed=1)  # other frozen weights: they must survive
    before = _values(fresh_model)
    with pytest.raises(CheckpointError, match="missing from it"):
        fresh.load_checkpoint(path, "t")
    # DeepSpeed's positional order: load_dir, tag, load_module_strict, load_optimizer_states
    loaded_path, _ = fresh.load_checkpoint(path, "t", False, True)
    after = _values(fresh_model)
    return {
        "path": loaded_path.endswith("t"),
        "adapter": torch.equal(after["adapter.weight"], trained["adapter.weight"]),
        "frozen_kept": torch.equal(after["base.weight"], before["base.weight"])
        and torch.equal(after["embed.weight"], before["embed.weight"]),
        "steps": fresh.global_steps,
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_without_frozen_parameters(ranks, tmp_path, stage):
    for result in ranks(2).run(check_exclude_frozen, str(tmp_path), stage, timeout=TIMEOUT):
        assert result == {"path": True, "adapter": True, "frozen_kept": True, "steps": 1}


def test_signatures_as_the_trainer_inspects_them():
    save = inspect.signature(zerolap.ZerolapEngine.save_checkpoint).parameters
    assert list(save)[1:] == [
        "save_dir", "tag", "client_state", "save_latest", "exclude_frozen_parameters"
    ]  # fmt: skip
    load = inspect.signature(zerolap.ZerolapEngine.load_checkpoint).parameters
    assert list(load)[1:] == [
        "load_dir", "tag", "load_module_strict", "load_optimizer_states",
        "load_lr_scheduler_states", "load_module_only", "custom_load_fn",
    ]  # fmt: skip


def check_custom_load_fn(path: str) -> dict:
    engine, _ = _engine(2)
    _train(engine)
    engine.save_checkpoint(path, "t")
    fresh, model = _engine(2, seed=1)
    seen = []

    def load(src, dst):
        seen.append((sorted(src), dst is model))
        dst.load_state_dict(src, strict=False)

    fresh.load_checkpoint(path, "t", custom_load_fn=load)
    return {"seen": seen}


def test_custom_load_fn_loads_the_module_states(ranks, tmp_path):
    for result in ranks(2).run(check_custom_load_fn, str(tmp_path), timeout=TIMEOUT):
        # the frozen weights, which the module states carry at stage 2
        assert result["seen"] == [
            (["base.bias", "base.weight", "embed.weight", "head.weight"], True)
        ]


def check_consolidated(stage: int) -> dict:
    engine, model = _engine(stage)
    _train(engine)
    if stage != 3:
        with pytest.raises(ValueError, match="needs ZeRO stage 3"):
            engine._zero3_consolidated_16bit_state_dict()
        state = engine._consolidated_16bit_state_dict()
    else:
        state = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    adapter = _values(model)["adapter.weight"]  # a collective: every rank
    if dist.get_rank() != 0:
        return {"none": state is None}
    return {
        "keys": sorted(state),
        "tied": state["head.weight"] is state["embed.weight"] if "embed.weight" in state else None,
        "adapter": torch.equal(state["adapter.weight"], adapter),
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_consolidated_16bit_state_dicts(ranks, stage):
    first, second = ranks(2).run(check_consolidated, stage, timeout=TIMEOUT)
    assert second == {"none": True}
    assert first["adapter"]
    if stage == 3:  # frozen ones left out, as the Trainer asks for PEFT models
        assert first["keys"] == ["adapter.weight"]
    else:
        assert first["tied"] is True and "base.weight" in first["keys"]
