"""Pipeline checkpoints as pieces of named parameters: saved by 2 stages, resumed by 4 stages
and by one stage with data parallelism 2 (no pipeline), each then equal to the run that never
stopped; and consolidated to the whole model's state dict, which the plain model loads."""

from __future__ import annotations

import pytest
import torch

import zerolap
from tests.pipe import models
from tests.pipe.test_engine import _config, _relative
from zerolap.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

GLOBAL_MICRO_BATCHES = 4  # per step: stages x gradient accumulation x data parallelism fixed


def run(stages: int, stage: int, steps: range, save: str | None = None, load: str | None = None):
    world = torch.distributed.get_world_size()
    data = world // stages
    gas = GLOBAL_MICRO_BATCHES // data
    module = models.pipeline(stages)
    engine, *_ = zerolap.initialize(model=module, config=_config(stage, gas))
    if load is not None:
        engine.load_checkpoint(load)
        assert engine.global_steps == steps.start
    for step in steps:
        batch = models.micro_batches(step, gas, data, engine.get_data_parallel_rank())
        engine.train_batch(iter(batch))
    if save is not None:
        engine.save_checkpoint(save)
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _merge(results: list[dict]) -> dict:
    merged = {}
    for params in results:
        merged.update(params)
    return merged


@pytest.mark.parametrize("stage", [1, 2])
def test_resume_at_another_number_of_stages_and_without_a_pipeline(ranks, tmp_path, stage):
    straight = _merge(ranks(2).run(run, 2, stage, range(6)))
    saved = str(tmp_path / "p2")
    at_save = _merge(ranks(2).run(run, 2, stage, range(3), saved))
    four = _merge(ranks(4).run(run, 4, stage, range(3, 6), None, saved))
    one = _merge(ranks(2).run(run, 1, stage, range(3, 6), None, saved))
    assert set(four) == set(one) == set(straight)
    for name, value in straight.items():
        assert _relative(four[name], value) < 1e-6, name
        assert _relative(one[name], value) < 1e-6, name

    whole = get_fp32_state_dict_from_zero_checkpoint(saved)
    plain = models.pipeline(1)
    plain.load_state_dict(whole, strict=True)  # the whole model's names, every parameter
    assert set(whole) == set(at_save)
    for name, value in at_save.items():
        assert torch.equal(whole[name], value), name
