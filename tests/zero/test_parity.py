"""Parameters after several AdamW steps equal those of one process on the whole global batch,
for stages 0-3, both reduction paths, overlap on and off, accumulation and clipping. Stage 3
runs with every module sharded (persistence threshold 0) and with small modules kept whole."""

from __future__ import annotations

import itertools

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.zero.models import global_batch, loss_fn, make_model
from zerolap.accelerator import get_accelerator

STEPS = 3
MICRO = 2
LR = 0.05

CONFIGS = [
    dict(stage=s, reduce_scatter=rs, overlap=ov, gas=gas, clip=clip, persist=0)
    for s, rs, ov, gas, clip in itertools.product(
        [0, 1, 2, 3], [True, False], [True, False], [1, 2], [0.0, 0.3]
    )
    if not (s == 0 and rs)
] + [
    # Stage 3 with the LayerNorm and the biases-only modules kept whole (persistent units).
    dict(stage=3, reduce_scatter=True, overlap=True, gas=gas, clip=0.3, persist=100)
    for gas in (1, 2)
]


def reference_params(gas: int, world: int, clip: float, device="cpu") -> list[torch.Tensor]:
    model = make_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step in range(STEPS):
        tokens, targets = (t.to(device) for t in global_batch(step, MICRO * gas * world))
        opt.zero_grad(set_to_none=False)  # flat buffers give unused params zero grads
        loss_fn(model(tokens, use_sometimes=step % 2 == 0), targets).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return [p.detach().cpu().clone() for p in model.parameters()]


def full_params(engine) -> list[torch.Tensor]:
    """The engine's parameters, whole (gathered under stage 3), on the CPU."""
    params = list(engine.module.parameters())
    with zerolap.zero.GatheredParameters(params):
        return [p.detach().cpu().clone() for p in params]


def train_engine(stage, reduce_scatter, overlap, gas, clip, persist) -> list[torch.Tensor]:
    """The engine's parameters after ``STEPS`` steps, trained on its device."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": stage,
            "reduce_scatter": reduce_scatter,
            "overlap_comm": overlap,
            "reduce_bucket_size": 200,
            "stage3_param_persistence_threshold": persist,
        },
    }
    engine, *_ = zerolap.initialize(model=make_model(), config=config)
    for step in range(STEPS):
        tokens, targets = (t.to(engine.device) for t in global_batch(step, MICRO * gas * world))
        for micro in range(gas):
            # Global sample order: micro-batch m of rank r is block (m * world + r).
            lo = (micro * world + rank) * MICRO
            logits = engine(tokens[lo : lo + MICRO], use_sometimes=step % 2 == 0)
            engine.backward(loss_fn(logits, targets[lo : lo + MICRO]))
            engine.step()
    assert engine.global_steps == STEPS and engine.micro_steps == STEPS * gas
    return full_params(engine)


def check_parity() -> list[str]:
    """Each config against one process on the same device (on a GPU, its kernels both)."""
    failures = []
    device = get_accelerator().current_device_name()
    for cfg in CONFIGS:
        got = train_engine(**cfg)
        want = reference_params(cfg["gas"], dist.get_world_size(), cfg["clip"], device)
        worst = max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))
        if worst > 1e-5:
            failures.append(f"{cfg}: max |diff| {worst:.2e}")
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parity_with_single_process(ranks, world_size):
    failures = ranks(world_size).run(check_parity, timeout=240)
    assert failures == [[]] * world_size, "\n".join(failures[0])


class SharedInCheckpoint(torch.nn.Module):
    """``shared`` is used inside a reentrant-checkpointed block and again outside it, so its
    gradient is accumulated twice in one backward (the inner backward runs separately)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 1)
        # Registered last, so its buckets launch first: the inner backward's gradient arrives
        # after the bucket's reduction started (a late gradient, reduced in a second round).
        self.shared = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda t: torch.tanh(self.shared(self.first(t))), x, use_reentrant=True)
        return self.head(self.shared(h))


def _batch(step: int, size: int) -> torch.Tensor:
    return torch.randn(size, 6, generator=torch.Generator().manual_seed(step), requires_grad=True)


def check_gradients_arriving_twice() -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    for stage, overlap in itertools.product([0, 1, 2, 3], [True, False]):
        reference = SharedInCheckpoint()
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {
                "stage": stage,
                "overlap_comm": overlap,
                "reduce_bucket_size": 40,
                "stage3_param_persistence_threshold": 0,
            },
        }
        engine, *_ = zerolap.initialize(model=SharedInCheckpoint(), config=config)
        for step in range(STEPS):
            x = _batch(step, 4 * world)
            mine = x[rank * 4 : rank * 4 + 4].detach().requires_grad_()
            # Two backward calls before one step: their gradients add up.
            for half in (mine[:2], mine[2:]):
                engine.backward(0.5 * engine(half).pow(2).mean())
            engine.step()
            ref_opt.zero_grad(set_to_none=False)
            reference(x).pow(2).mean().backward()
            ref_opt.step()
        worst = max(
            (a - b).abs().max().item()
            for a, b in zip(full_params(engine), reference.parameters(), strict=True)
        )
        if worst > 1e-5:
            failures.append(f"stage {stage} overlap {overlap}: max |diff| {worst:.2e}")
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradients_arriving_twice_accumulate(ranks, world_size):
    failures = ranks(world_size).run(check_gradients_arriving_twice)
    assert failures == [[]] * world_size, "\n".join(failures[0])
