"""Tensor-parallel checkpoints hold pieces of the whole parameters: a run saved at TP 2 x DP 2
resumes at TP 4, at TP 1 (plain data parallelism) and at another ZeRO stage, continuing exactly
as the dense run does, and consolidates to the dense model's state dict."""

from __future__ import annotations

import pytest
import torch

import zerolap
import zerolap.comm as dist
from zerolap.checkpoint.consolidate import get_fp32_state_dict
from zerolap.demo.gpt import GPT, GPTConfig, synthetic_batch

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=4, d_model=16)
GLOBAL, LR, CLIP = 8, 0.01, 0.05


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def dense(steps: int) -> GPT:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step in range(steps):
        tokens, targets = synthetic_batch(CFG, GLOBAL, seed=step)
        opt.zero_grad()
        model(tokens, targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return model


def _engine(stage: int, tensor: int):
    data = dist.get_world_size() // tensor
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL // data,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
        "tensor_parallel": {"autotp_size": tensor},
    }
    engine, *_ = zerolap.initialize(model=_model(), config=config)
    return engine


def _train(engine, steps: range) -> None:
    data, data_rank = engine.dp_world_size, engine.get_data_parallel_rank()
    micro = GLOBAL // data
    for step in steps:
        tokens, targets = synthetic_batch(CFG, GLOBAL, seed=step)
        lo = data_rank * micro
        engine.backward(engine(tokens[lo : lo + micro], targets[lo : lo + micro]))
        engine.step()


def save_then_resume(path: str, saved_at: tuple[int, int], resumed_at: tuple[int, int]):
    engine = _engine(*saved_at)
    _train(engine, range(2))
    engine.save_checkpoint(path, tag="two")
    whole = engine._consolidated_16bit_state_dict()
    engine.destroy()
    engine = _engine(*resumed_at)
    engine.load_checkpoint(path, tag="two")
    assert engine.global_steps == 2
    _train(engine, range(2, 3))
    state = engine._consolidated_16bit_state_dict()
    engine.destroy()
    if dist.get_rank() != 0:
        return None
    problems = []
    for label, got, want in (
        ("after save", whole, dense(2).state_dict()),
        ("after resume", state, dense(3).state_dict()),
        ("consolidated", get_fp32_state_dict(path, "two"), dense(2).state_dict()),
    ):
        assert got.keys() == want.keys(), label
        for key, value in want.items():
            worst = (got[key] - value).abs().max().item()
            if worst > 1e-5:
                problems.append(f"{label} {key}: {worst:.2e}")
    return problems


@pytest.mark.parametrize(
    "saved_at,resumed_at",
    [((2, 2), (2, 4)), ((3, 2), (1, 1)), ((1, 4), (3, 2)), ((0, 2), (2, 2))],
    ids=["tp2-to-tp4", "z3tp2-to-dense", "tp4-to-z3tp2", "z0tp2-to-z2tp2"],
)
def test_resume_across_tensor_parallel_sizes(ranks, tmp_path, saved_at, resumed_at):
    results = ranks(4).run(save_then_resume, str(tmp_path), saved_at, resumed_at, timeout=240)
    assert results[0] == [], results[0]
