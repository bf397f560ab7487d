"""``deepspeed.ops``' optimizers are torch's kernels with DeepSpeed's arguments: the same update
as ``torch.optim.AdamW`` / ``Adam`` / ``Adagrad``, the mode flags honoured."""

from __future__ import annotations

import pytest
import torch

from zerolap.ops.adagrad import DeepSpeedCPUAdagrad
from zerolap.ops.adam import DeepSpeedCPUAdam, FusedAdam


def _run(optimizer_class, dtype=torch.float32, **kwargs) -> torch.Tensor:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64, dtype=dtype))
    optimizer = optimizer_class([param], **kwargs)
    for step in range(3):
        param.grad = torch.randn(64, generator=torch.Generator().manual_seed(step)).to(dtype)
        optimizer.step()
    return param.detach()


@pytest.mark.parametrize("cls", [FusedAdam, DeepSpeedCPUAdam])
def test_adam_modes_match_torch(cls):
    flag = "adam_w_mode" if cls is FusedAdam else "adamw_mode"
    args = {"lr": 0.1, "weight_decay": 0.1}
    # torch's fused kernel, bit for bit
    assert torch.equal(_run(cls, **args), _run(torch.optim.AdamW, fused=True, **args))
    assert torch.equal(
        _run(cls, **args, **{flag: False}), _run(torch.optim.Adam, fused=True, **args)
    )


def test_cpu_adagrad_matches_torch():
    assert torch.allclose(
        _run(DeepSpeedCPUAdagrad, lr=0.1), _run(torch.optim.Adagrad, lr=0.1), atol=1e-7
    )


def test_refused_arguments_are_named():
    with pytest.raises(ValueError, match="bias_correction=False"):
        FusedAdam([torch.nn.Parameter(torch.ones(2))], bias_correction=False)
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdagrad([torch.nn.Parameter(torch.ones(2))], amsgrad=True)
    with pytest.raises(ValueError, match=r"is torch\.bfloat16"):
        _run(DeepSpeedCPUAdam, dtype=torch.bfloat16)  # fp32 states promised, bf16 parameters
    _run(DeepSpeedCPUAdam, dtype=torch.bfloat16, fp32_optimizer_states=False)
