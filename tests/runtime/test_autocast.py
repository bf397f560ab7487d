"""ds_config ``torch_autocast``: the engine's forward under ``torch.autocast`` (bf16), training
as one process does under the same autocast; what zerolap cannot honour refused by name."""

from __future__ import annotations

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.config.helpers import load, load_error
from tests.zero.models import global_batch, loss_fn, make_model

AUTOCAST = {"enabled": True, "dtype": "torch.bfloat16"}  # as DeepSpeed's examples write it


def test_the_section_loads_and_refuses_what_it_cannot_honour():
    assert load({"torch_autocast": AUTOCAST}).torch_autocast.torch_dtype == torch.bfloat16
    assert "torch_autocast.dtype: zerolap autocasts to bf16 only" in load_error(
        {"torch_autocast": {"enabled": True, "dtype": "torch.float16"}}
    )
    modules = {**AUTOCAST, "lower_precision_safe_modules": ["torch.nn.Linear"]}
    assert "torch_autocast.lower_precision_safe_modules: zerolap reduces every" in load_error(
        {"torch_autocast": modules}
    )
    # An empty list reduces each gradient in its parameter's dtype, as zerolap does.
    assert load({"torch_autocast": {**AUTOCAST, "lower_precision_safe_modules": []}})
    # Without a dtype: bf16 (DeepSpeed then takes torch's default for the device).
    assert load({"torch_autocast": {"enabled": True}}).torch_autocast.torch_dtype == torch.bfloat16
    assert "torch_autocast.enabled, fp16.enabled: autocast to bf16 over fp16" in load_error(
        {"torch_autocast": AUTOCAST, "fp16": {"enabled": True}}
    )
    tensor = {"tensor_parallel": {"autotp_size": 2}, "torch_autocast": AUTOCAST}
    assert "torch_autocast.enabled, tensor_parallel.autotp_size: tensor-parallel layers" in (
        load_error(tensor, world_size=2)
    )
    # Off, the section says nothing, whatever it holds (DeepSpeed's default config writes it).
    assert not load({"torch_autocast": {"enabled": False, "dtype": "fp16"}}).torch_autocast.enabled


def train_under_autocast(stage: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "torch_autocast": AUTOCAST,
    }
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    engine, *_ = zerolap.initialize(model=model, optimizer=optimizer, config=config)
    assert engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.bfloat16
    reference = make_model()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.02)
    dtypes = set()
    for step in range(3):
        tokens, targets = global_batch(step, 2 * world)
        mine = slice(2 * rank, 2 * rank + 2)
        logits = engine(tokens[mine])
        dtypes.add(logits.dtype)
        engine.backward(loss_fn(logits.float(), targets[mine]))
        engine.step()
        ref_optimizer.zero_grad()
        for part in range(world):
            chunk = slice(2 * part, 2 * part + 2)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = reference(tokens[chunk])
            (loss_fn(out.float(), targets[chunk]) / world).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_optimizer.step()
    params = list(engine.module.parameters())
    with zerolap.zero.GatheredParameters(params):
        worst = max(
            ((p - r).abs().max() / r.abs().max()).item()
            for p, r in zip(params, reference.parameters(), strict=True)
        )
        dense = make_model()  # the same steps without autocast end elsewhere
        dense_optimizer = torch.optim.AdamW(dense.parameters(), lr=0.02)
        for step in range(3):
            tokens, targets = global_batch(step, 2 * world)
            dense_optimizer.zero_grad()
            loss_fn(dense(tokens).float(), targets).backward()
            torch.nn.utils.clip_grad_norm_(dense.parameters(), 1.0)
            dense_optimizer.step()
        apart = max(
            ((p - d).abs().max() / d.abs().max()).item()
            for p, d in zip(params, dense.parameters(), strict=True)
        )
    engine.destroy()
    return {"dtypes": dtypes, "worst": worst, "apart": apart}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_training_under_autocast_equals_one_process(ranks, stage):
    for result in ranks(2).run(train_under_autocast, stage):
        assert result["dtypes"] == {torch.bfloat16}  # the model's last Linear, autocast
        assert result["worst"] < 1e-5, result
        assert result["apart"] > 1e-4, result  # autocast changed the numerics: not ignored
