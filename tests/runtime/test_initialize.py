"""``zerolap.initialize`` and the engine's DeepSpeed surface: the 4-tuple, optimizer and
scheduler sources, config sources, accessors, attribute forwarding, GatheredParameters."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.logs import captured_logs
from zerolap.config import ConfigError
from zerolap.config.root import parse_config


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    model.answer = 42
    return model


BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}


def check_four_tuple_and_accessors(tmp: str) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    data = torch.utils.data.TensorDataset(torch.arange(16.0).reshape(16, 1).repeat(1, 4))
    config = dict(
        BASE,
        optimizer={"type": "SGD", "params": {"lr": 0.1}},
        scheduler={
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": 0.1,
                "warmup_num_steps": 4,
                "warmup_type": "linear",
            },
        },
        zero_optimization={"stage": 1},
    )
    path = f"{tmp}/ds_config_{rank}.json"
    with open(path, "w") as f:
        json.dump(config, f)
    args = argparse.Namespace(deepspeed=True, deepspeed_config=path)
    engine, optimizer, loader, scheduler = zerolap.initialize(
        args=args, model=_model(), training_data=data
    )
    assert isinstance(engine, zerolap.DeepSpeedEngine)
    assert optimizer is engine.optimizer and scheduler is engine.lr_scheduler
    seen = [batch[0][:, 0].tolist() for batch in loader]
    assert len(seen) == 16 // (2 * n) and all(len(b) == 2 for b in seen)
    assert engine.answer == 42  # forwarded to the module
    assert (
        engine.train_batch_size(),
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
    ) == (4 * n, 2, 2)
    assert engine.zero_optimization_stage() == 1
    assert engine.world_size == n and engine.global_rank == rank
    lrs = []
    for batch in loader:
        assert engine.is_gradient_accumulation_boundary() == (engine.micro_steps % 2 == 1)
        engine.backward(engine(batch[0]).mean())
        engine.step()
        lrs.append(engine.get_lr()[0])
    assert engine.global_steps == len(seen) // 2 and engine.micro_steps == len(seen)
    assert engine.global_samples == engine.global_steps * 4 * n
    assert engine.was_step_applied() and engine.get_global_grad_norm() > 0
    return {"samples": sorted(x for b in seen for x in b), "lrs": lrs}


def ramp_the_batch() -> dict:
    """set_train_batch_size between steps: the next step takes the new count of micro-batches
    (the boundary counts this step's, whatever came before); refused mid-step."""
    config = {**BASE, "gradient_accumulation_steps": 1}
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    engine, *_ = zerolap.initialize(model=_model(), config=config)
    n = dist.get_world_size()
    steps_after, errors = [], []

    def micro_batch() -> None:
        engine.backward(engine(torch.ones(2, 4)).mean())
        engine.step()
        steps_after.append(engine.global_steps)

    for count in (1, 3, 2):  # micro-batches per step: 1, then 3, then 2
        engine.set_train_batch_size(2 * n * count)
        for _ in range(count):
            micro_batch()
            if engine.micro_in_step == 1:  # one micro-batch into a step
                try:
                    engine.set_train_batch_size(2 * n)
                except RuntimeError as error:
                    errors.append(str(error))
    try:
        engine.set_train_batch_size(2 * n + 1)
    except ValueError as error:
        errors.append(str(error))
    return {"steps": steps_after, "errors": errors, "samples": engine.global_samples}


def test_set_train_batch_size_changes_the_micro_batches_per_step(ranks):
    result = ranks(2).run(ramp_the_batch)[0]
    assert result["steps"] == [1, 1, 1, 2, 2, 3]
    assert result["samples"] == 4 * (1 + 3 + 2)
    assert result["errors"][:2] == [
        f"set_train_batch_size() 1 micro-batch(es) into step {step}: call it between steps"
        for step in (2, 3)
    ]
    assert result["errors"][-1].startswith("set_train_batch_size(5): the global batch must be")


def test_initialize_returns_the_four_tuple(ranks, tmp_path):
    results = ranks(2).run(check_four_tuple_and_accessors, str(tmp_path))
    # The sampler splits the data between ranks, each sample once.
    assert sorted(results[0]["samples"] + results[1]["samples"]) == [float(i) for i in range(16)]
    # WarmupLR (linear over 4 steps) advances once per optimizer step, not per micro-batch:
    # DeepSpeed's counting gives max_lr * i / 4 after step i + 1.
    assert results[0]["lrs"] == pytest.approx([0.0, 0.0, 0.0, 0.025])


def check_optimizer_and_scheduler_sources() -> None:
    model = _model()
    client = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(client, step_size=1, gamma=0.5)
    with captured_logs() as caught:
        engine, opt, _, returned = zerolap.initialize(
            model=model,
            optimizer=client,
            lr_scheduler=sched,
            config=dict(BASE, optimizer={"type": "AdamW", "params": {"lr": 1.0}}),
        )
    if dist.get_rank() == 0:
        assert any("overrides ds_config's optimizer.type=AdamW" in w for w in caught)
    assert opt.inner is client and returned is sched
    for _ in range(2):
        engine.backward(engine(torch.ones(2, 4)).mean())
        engine.step()
    assert engine.get_lr() == [0.25]  # the client's scheduler drives the client's optimizer
    engine, opt, _, sched = zerolap.initialize(
        model=_model(),
        config=BASE,
        optimizer=lambda params: torch.optim.Adam(params, lr=0.01),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5),
    )
    assert isinstance(opt.inner, torch.optim.Adam) and engine.get_lr() == [0.005]
    assert engine.get_mom() == [(0.9, 0.999)]  # DeepSpeed's name: Adam's betas
    sgd = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.8}}
    engine, *_ = zerolap.initialize(model=_model(), config=dict(BASE, optimizer=sgd))
    assert engine.get_mom() == [0.8]
    # An empty group (the Trainer's "no decay" group of a LoRA model) is dropped, as DeepSpeed
    # drops it: a scheduler made after initialize, and one DeepSpeed saved, count one group.
    model = _model()
    groups = [{"params": list(model.parameters())}, {"params": [], "weight_decay": 0.0}]
    engine, opt, *_ = zerolap.initialize(
        model=model, optimizer=torch.optim.AdamW(groups, lr=0.1), config=BASE
    )
    assert len(opt.param_groups) == 1 and engine.get_lr() == [0.1]


def test_optimizer_and_scheduler_sources(ranks):
    ranks(2).run(check_optimizer_and_scheduler_sources)


def check_config_sources_and_warning() -> None:
    with pytest.raises(ConfigError, match="no ds_config"):
        zerolap.initialize(model=_model())
    args = argparse.Namespace(deepspeed_config="x.json")
    with pytest.raises(ConfigError, match="given twice"):
        zerolap.initialize(args=args, model=_model(), config=BASE)
    with captured_logs() as caught:
        zerolap.initialize(
            model=_model(),
            config_params=dict(
                BASE,
                optimizer={"type": "SGD", "params": {"lr": 0.1}},
                autotuning={"enabled": True},
                graph_harvesting=True,
            ),
        )
    messages = [w for w in caught if "does not implement" in w]
    if dist.get_rank() == 0:
        assert len(messages) == 1 and "autotuning" in messages[0]
        assert "graph_harvesting" in messages[0]
    else:
        assert messages == []


def test_config_sources_and_unsupported_key_warning(ranks):
    ranks(2).run(check_config_sources_and_warning)


def check_gathered_parameters_modifier_rank() -> list[float]:
    engine, *_ = zerolap.initialize(
        model=_model(),
        config=dict(
            BASE, optimizer={"type": "SGD", "params": {"lr": 0.1}}, zero_optimization={"stage": 2}
        ),
    )
    weight = engine.module[0].bias
    with zerolap.zero.GatheredParameters(weight, modifier_rank=1) as params, torch.no_grad():
        assert params == [weight]
        params[0].fill_(float(dist.get_rank() + 7))
    return weight.tolist()


def test_gathered_parameters_broadcasts_the_modifier(ranks):
    for values in ranks(2).run(check_gathered_parameters_modifier_rank):
        assert values == [8.0] * 8


class _Rotary(torch.nn.Module):
    """A rotary embedding's fp32 table beside a layer, as transformers' models hold them."""

    _keep_in_fp32_modules_strict = ("scale",)

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 4, 2) / 4))
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("steps", torch.zeros(1, dtype=torch.long))

    def forward(self, x):
        return self.proj(x) * self.scale


def bf16_dtypes(data_types: dict | None) -> dict:
    config = dict(BASE, bf16={"enabled": True}, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    if data_types is not None:
        config["data_types"] = data_types
    with captured_logs() as logs:
        engine, *_ = zerolap.initialize(model=_Rotary(), config=config)
    module = engine.module
    return {
        "params": {str(p.dtype) for p in module.parameters()},
        "buffers": {n: str(b.dtype) for n, b in module.named_buffers()},
        "warned": [line for line in logs if "grad_accum_dtype" in line],
    }


def test_bf16_casts_parameters_and_keeps_buffers_as_loaded(ranks):
    # Cast with the parameters, a rotary table's angles were off by up to 0.22 at position
    # 512 (bf16 keeps 8 bits of mantissa).
    plain = ranks(1).run(bf16_dtypes, None)[0]
    assert plain["params"] == {"torch.bfloat16"}
    assert plain["buffers"] == {
        "inv_freq": "torch.float32",
        "scale": "torch.float32",
        "steps": "torch.int64",
    }
    # buffer_dtype casts the floating ones, but those the model keeps in fp32.
    cast = ranks(1).run(bf16_dtypes, {"buffer_dtype": "bf16"})[0]
    assert cast["buffers"] == {
        "inv_freq": "torch.bfloat16",
        "scale": "torch.float32",
        "steps": "torch.int64",
    }
    listed = ranks(1).run(bf16_dtypes, {"buffer_dtype": "bf16", "keep_in_fp32_modules": ["inv*"]})
    assert listed[0]["buffers"]["inv_freq"] == "torch.float32"
    assert listed[0]["buffers"]["scale"] == "torch.bfloat16"
    with pytest.raises(ConfigError, match=r"data_types\.param_dtype: 'fp16', but the parameters"):
        parse_config(dict(BASE, bf16={"enabled": True}, data_types={"param_dtype": "fp16"}))
    accumulated = ranks(1).run(bf16_dtypes, {"grad_accum_dtype": "bf16"})[0]
    assert len(accumulated["warned"]) == 1
    assert "data_types.grad_accum_dtype: 'bf16' is not implemented" in accumulated["warned"][0]
