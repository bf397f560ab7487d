"""The flops profiler: MACs against hand-computed formulas, attributed to the module that ran
them; DeepSpeed's ``FlopsProfiler`` and ``get_model_profile`` interfaces; and ds_config's
``flops_profiler`` on a 2-rank engine (timed at ``profile_step``, counted on the next forward)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import zerolap
from zerolap.config import ConfigError
from zerolap.profiling.flops import FlopsProfiler, get_model_profile, number_to_string

B, S, W, HEADS = 4, 8, 16, 2


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(W, 3 * W)
        self.proj = nn.Linear(W, W, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, S, 3, HEADS, W // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, S, W))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.norm = nn.LayerNorm(W)
        self.conv = nn.Conv1d(W, W, kernel_size=3, padding=1)

    def forward(self, x):
        x = self.norm(x + self.attn(x))
        y = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return (y @ y.transpose(1, 2)).mean()  # a bmm of the model's own


QKV = B * S * W * 3 * W
SDPA = 2 * B * HEADS * S * S * (W // HEADS)  # scores and the weighted sum; causality ignored
PROJ = B * S * W * W
CONV = B * S * W * W * 3
OWN = B * S * W * S  # the model's own bmm
TOTAL = QKV + SDPA + PROJ + CONV + OWN


def test_macs_by_formula_and_by_module():
    torch.manual_seed(0)
    model = Net()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(B, S, W)).backward()  # the backward's products are not counted
    profile = prof.profile
    assert prof.get_total_macs() == TOTAL and prof.get_total_flops() == 2 * TOTAL
    assert profile.macs(model.attn) == QKV + SDPA + PROJ
    assert profile.macs(model.attn.qkv) == QKV and profile.macs(model.attn.proj) == PROJ
    assert profile.own_flops[model.attn] == 2 * SDPA  # attention's own, outside its Linears
    assert profile.macs(model.conv) == CONV and profile.macs(model.norm) == 0
    assert profile.own_flops[model] == 2 * OWN
    assert prof.get_total_params() == sum(p.numel() for p in model.parameters())
    assert prof.get_total_duration() > profile.latency(model.attn) > 0
    prof.reset_profile()
    assert prof.get_total_macs() == 0
    model(torch.randn(B, S, W))
    assert prof.get_total_macs() == TOTAL  # recording goes on after a reset
    prof.end_profile()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with pytest.raises(RuntimeError, match="start_profile"):
        prof.get_total_flops()


def test_ignored_modules_count_in_their_parent():
    model = Net()
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[nn.Linear])
    model(torch.randn(B, S, W))
    assert prof.profile.own_flops[model.attn] == 2 * (QKV + SDPA + PROJ)
    assert prof.get_total_macs() == TOTAL
    prof.end_profile()


def test_get_model_profile_returns_and_prints(tmp_path):
    model = Net()
    out = tmp_path / "profiles" / "net.txt"
    flops, macs, params = get_model_profile(
        model, input_shape=(B, S, W), as_string=False, output_file=str(out), module_depth=1
    )
    assert (flops, macs) == (2 * TOTAL, TOTAL)
    assert params == sum(p.numel() for p in model.parameters())
    text = out.read_text()
    assert re.search(rf"\nfwd MACs per GPU: +{number_to_string(TOTAL)}MACs\n", text)
    assert "(attn): Attention(" in text and "(qkv)" not in text  # module_depth 1
    assert not any(m._forward_hooks for m in model.modules())
    as_strings = get_model_profile(model, args=[torch.randn(B, S, W)], print_profile=False)
    assert as_strings == (
        number_to_string(2 * TOTAL),
        number_to_string(TOTAL) + "MACs",
        number_to_string(params).rstrip(),
    )
    with pytest.raises(ValueError, match="not both"):
        get_model_profile(model, input_shape=(B, S, W), args=[torch.randn(B, S, W)])


def test_number_strings():
    assert number_to_string(336_230_000) == "336.23 M"
    assert number_to_string(2048) == "2.05 K" and number_to_string(12) == "12 "


def check_engine_profile(out: str) -> dict:
    torch.manual_seed(0)
    model = Net()
    config = {
        "train_micro_batch_size_per_gpu": B,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": out},
    }
    engine, *_ = zerolap.initialize(model=model, config=config)
    written_after = None
    for _ in range(3 * 2):  # 3 steps of 2 micro-batches
        if written_after is None and os.path.exists(out):
            written_after = (engine.global_steps, engine.micro_in_step)
        engine.backward(engine(torch.randn(B, S, W)))
        engine.step()
    profiling = engine._flops is not None
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    engine.destroy()
    return {"written_after": written_after, "profiling": profiling, "hooks": hooks}


def test_engine_times_profile_step_and_counts_the_next_forward(ranks, tmp_path):
    out = str(tmp_path / "flops.txt")
    first, second = ranks(2).run(check_engine_profile, out)
    assert first["profiling"] and not second["profiling"]  # rank 0 alone
    # Not there before step 2's first forward (step 1 is the timed one), there after it.
    assert first["written_after"] == (2, 1)
    assert first["hooks"] == 0  # every profiling hook gone once printed
    text = (tmp_path / "flops.txt").read_text()
    assert "Profile Summary at step 1:" in text
    lines = {line.split(":")[0].strip(): line.rsplit(None, 2)[-2:] for line in text.splitlines()}
    assert lines["world size"][-1] == "2" and lines["data parallel size"][-1] == "2"
    assert lines["batch size per GPU"][-1] == str(B)
    assert " ".join(lines["fwd MACs per GPU"]) == number_to_string(TOTAL) + "MACs"
    for key in ("fwd latency", "bwd latency", "step latency", "iter latency"):
        assert key in lines, key
    assert float(lines["samples/second"][-1]) > 0


def check_pipeline_refused() -> str:
    from tests.pipe import models
    from tests.pipe.test_engine import _config

    config = _config(1, 2, flops_profiler={"enabled": True})
    with pytest.raises(ConfigError) as caught:
        zerolap.initialize(model=models.pipeline(2), config=config)
    return str(caught.value)


def test_a_pipeline_with_the_profiler_is_refused(ranks):
    for message in ranks(2).run(check_pipeline_refused):
        assert "flops_profiler.enabled with a PipelineModule" in message


class Shared(nn.Module):
    """One Linear held by two parents, and called by both."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(W, W)
        self.enc, self.dec = nn.Sequential(shared), nn.Sequential(shared)

    def forward(self, x):
        return self.dec(self.enc(x))


def test_a_module_held_twice_counts_once_in_the_totals():
    model = Shared()
    flops, macs, _ = get_model_profile(model, input_shape=(B, W), as_string=False)
    assert macs == 2 * B * W * W  # two calls of one Linear, not four
    assert flops == 2 * macs


def test_a_forward_that_raises_leaves_no_counting_behind():
    model = Net()
    prof = FlopsProfiler(model)
    prof.start_profile()
    with pytest.raises(RuntimeError):
        model(torch.randn(B, S, W + 1))  # the wrong width: the first Linear raises
    prof.end_profile()
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _sgd_engine(model: nn.Module, *, profile_step: int, out: str):
    """An SGD engine over ``model`` profiling step ``profile_step`` into ``out``."""
    config = {
        "train_micro_batch_size_per_gpu": B,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "flops_profiler": {"enabled": True, "profile_step": profile_step, "output_file": out},
    }
    engine, *_ = zerolap.initialize(model=model, config=config)
    return engine


class Checkpointed(nn.Module):
    """A child run under activation checkpointing: recomputed in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(W, W), nn.Tanh())

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False).sum()


def check_eval_and_recompute_are_not_profiled(out: str) -> dict:
    torch.manual_seed(0)
    model = Checkpointed()
    engine = _sgd_engine(model, profile_step=1, out=out)
    profile = engine._flops
    for step in range(3):
        with torch.no_grad():  # evaluations inside the timed step and before the counted one
            engine(torch.randn(8 * B, W))
        engine.backward(engine(torch.randn(B, W)))
        engine.step()
        if profile is not None and step == 1:
            timed_forwards = profile._forwards
            inner = profile.timed.latency(model.inner)
            whole = profile.timed.latency(model)
    engine.destroy()
    if profile is None:
        return {}
    return {"forwards": timed_forwards, "inner_within": inner <= whole}


def test_evaluation_and_recompute_stay_out_of_the_profile(ranks, tmp_path):
    out = tmp_path / "flops.txt"
    first, _ = ranks(2).run(check_eval_and_recompute_are_not_profiled, str(out))
    assert first == {"forwards": 1, "inner_within": True}  # the one training micro-batch
    text = out.read_text()
    # Counted on the next training forward (batch B), not on the evaluation (batch 8 B).
    assert re.search(rf"\nfwd MACs per GPU: +{number_to_string(B * W * W)}MACs\n", text)


def test_the_first_profile_in_a_process_does_not_time_torchs_imports():
    # The first operation through a Python dispatch mode imports about a second of torch;
    # start_profile takes that, not the first profiled module.
    script = (
        "import torch\n"
        "from zerolap.profiling.flops import FlopsProfiler\n"
        "model = torch.nn.Sequential(torch.nn.Linear(64, 64))\n"
        "prof = FlopsProfiler(model)\n"
        "prof.start_profile()\n"
        "model(torch.randn(8, 64))\n"
        "print(prof.get_total_duration())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[-1]) < 0.25  # ~1 ms; with the imports, ~1 s


def check_a_raising_forward_leaves_no_hooks(out: str) -> dict:
    torch.manual_seed(0)
    model = Net()
    engine = _sgd_engine(model, profile_step=0, out=out)
    with pytest.raises(RuntimeError):
        engine(torch.randn(B, S, W + 1))  # the wrong width, inside the timed step
    left = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    for _ in range(2):
        engine.backward(engine(torch.randn(B, S, W)))
        engine.step()
    engine(torch.randn(B, S, W))  # the counted forward
    return {"left": left, "written": os.path.exists(out)}


def test_a_forward_that_raises_in_the_engine_takes_its_hooks_off(ranks, tmp_path):
    first, _ = ranks(2).run(check_a_raising_forward_leaves_no_hooks, str(tmp_path / "f.txt"))
    assert first == {"left": 0, "written": True}
