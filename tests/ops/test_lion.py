"""``deepspeed.ops.lion`` and ds_config's ``"type": "Lion"``: the paper's update element by
element (an element whose direction is zero stays put, where DeepSpeed's kernels move it by
lr), DeepSpeed's argument names, and the engine training with it at ZeRO 2 and 3 (and with
its momentum swapped to disk) as one process does."""

from __future__ import annotations

import pytest
import torch

import zerolap.comm as dist
from zerolap.ops.lion import DeepSpeedCPULion, FusedLion

TIMEOUT = 120.0


def _reference(p, grads, lr, betas, weight_decay):
    """Lion for one tensor, element by element in Python floats."""
    p, m = [float(x) for x in p], [0.0] * len(p)
    for g in grads:
        g = [float(x) for x in g]
        for i in range(len(p)):
            c = betas[0] * m[i] + (1 - betas[0]) * g[i]
            direction = (c > 0) - (c < 0)
            p[i] = p[i] * (1 - lr * weight_decay) - lr * direction
            m[i] = betas[1] * m[i] + (1 - betas[1]) * g[i]
    return torch.tensor(p)


@pytest.mark.parametrize("cls", [FusedLion, DeepSpeedCPULion])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_update_is_lions(cls, weight_decay):
    start = torch.randn(16, generator=torch.Generator().manual_seed(0))
    grads = [torch.randn(16, generator=torch.Generator().manual_seed(1 + k)) for k in range(4)]
    for g in grads:
        g[:4] = 0.0  # never a gradient here: no direction, so only weight decay moves them
    param = torch.nn.Parameter(start.clone())
    optimizer = cls([param], lr=0.01, betas=(0.9, 0.99), weight_decay=weight_decay)
    for g in grads:
        param.grad = g.clone()
        optimizer.step()
    expected = _reference(start, grads, 0.01, (0.9, 0.99), weight_decay)
    assert torch.allclose(param.detach(), expected, atol=1e-6)
    decayed = start[:4] * (1 - 0.01 * weight_decay) ** 4
    assert torch.allclose(param.detach()[:4], decayed, rtol=1e-6, atol=0)
    assert set(optimizer.state[param]) == {"step", "exp_avg"}
    assert optimizer.state[param]["step"] == 4


def test_deepspeeds_arguments_and_refusals():
    param = torch.nn.Parameter(torch.ones(2))
    assert FusedLion([param]).defaults == {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}
    with pytest.raises(ValueError, match=r"betas must lie in \[0, 1\)"):
        FusedLion([param], betas=(0.9, 1.0))
    bf16 = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    bf16.grad = torch.ones_like(bf16)
    with pytest.raises(
        ValueError, match=r"DeepSpeedCPULion\(fp32_optimizer_states=True\).*bfloat16"
    ):
        DeepSpeedCPULion([bf16]).step()
    DeepSpeedCPULion([bf16], fp32_optimizer_states=False).step()


def train_with_lion(stage: int, offload: str | None, root: str) -> float:
    import zerolap

    rank, world = dist.get_rank(), dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "sub_group_size": 100},
        "optimizer": {
            "type": "Lion",
            "params": {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.1},
        },
    }
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": offload, "nvme_path": root}

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    engine, *_ = zerolap.initialize(model=model(), config=config)
    dense = model()
    optimizer = FusedLion(dense.parameters(), lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * world, 8, generator=g), torch.randn(2 * world, 4, generator=g)
        mine = slice(2 * rank, 2 * rank + 2)
        engine.backward(torch.nn.functional.mse_loss(engine(x[mine]), y[mine]))
        engine.step()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(dense(x), y).backward()
        torch.nn.utils.clip_grad_norm_(dense.parameters(), 1.0)
        optimizer.step()
    return max(
        (zerolap.utils.safe_get_full_fp32_param(p) - q).abs().max().item()
        for p, q in zip(engine.module.parameters(), dense.parameters(), strict=True)
    )


@pytest.mark.parametrize(("stage", "offload"), [(2, None), (3, None), (2, "nvme")])
def test_a_ds_config_lion_trains_as_one_process(ranks, stage, offload, tmp_path):
    for worst in ranks(2).run(train_with_lion, stage, offload, str(tmp_path), timeout=TIMEOUT):
        assert worst < 1e-6
