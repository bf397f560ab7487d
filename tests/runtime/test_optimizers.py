"""build_optimizer: DeepSpeed's Adam rules, name lookup, and its error messages."""

from __future__ import annotations

import pytest
import torch

from zerolap.ops.lion import FusedLion
from zerolap.runtime.optimizers import build_optimizer


def flat_param(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(64, generator=gen).requires_grad_(True)


def after_steps(optimizer: torch.optim.Optimizer, param: torch.Tensor, steps: int = 3):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        param.grad = torch.randn(param.shape, generator=gen)
        optimizer.step()
    return param.detach().clone()


def test_adam_defaults_to_decoupled_weight_decay():
    config = {"lr": 0.1, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.5}
    ours = flat_param()
    optimizer = build_optimizer("Adam", config, [ours])
    assert type(optimizer) is torch.optim.AdamW
    reference = flat_param()
    expected = after_steps(torch.optim.AdamW([reference], **config), reference)
    torch.testing.assert_close(after_steps(optimizer, ours), expected)
    # And the weight decay is visible: plain Adam with L2 lands elsewhere.
    l2 = flat_param()
    assert not torch.allclose(after_steps(torch.optim.Adam([l2], **config), l2), expected)


def test_adam_w_mode_false_gives_l2_adam():
    config = {"lr": 0.1, "weight_decay": 0.5}
    ours = flat_param()
    optimizer = build_optimizer("Adam", {**config, "adam_w_mode": False}, [ours])
    assert type(optimizer) is torch.optim.Adam
    reference = flat_param()
    expected = after_steps(torch.optim.Adam([reference], **config), reference)
    torch.testing.assert_close(after_steps(optimizer, ours), expected)


def test_adamw_ignores_adam_w_mode_and_deepspeed_only_flags():
    config = {"adam_w_mode": False, "torch_adam": True, "bias_correction": True}
    optimizer = build_optimizer("AdamW", config, [flat_param()])
    assert type(optimizer) is torch.optim.AdamW
    assert config == {"adam_w_mode": False, "torch_adam": True, "bias_correction": True}


def test_adam_defaults_weight_decay_zero_and_fused():
    optimizer = build_optimizer("adamw", {}, [flat_param()])
    assert optimizer.defaults["weight_decay"] == 0.0
    assert optimizer.defaults["fused"] is True
    optimizer = build_optimizer("adamw", {"foreach": True}, [flat_param()])
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("ADAM", torch.optim.AdamW),
        ("sgd", torch.optim.SGD),
        ("SGD", torch.optim.SGD),
        ("RMSprop", torch.optim.RMSprop),
        ("adagrad", torch.optim.Adagrad),
        ("Lion", FusedLion),
    ],
)
def test_names_are_case_insensitive(name, cls):
    assert type(build_optimizer(name, {"lr": 0.01}, [flat_param()])) is cls


def test_torch_optimizer_gets_its_params():
    optimizer = build_optimizer("SGD", {"lr": 0.3, "momentum": 0.9}, [flat_param()])
    assert optimizer.defaults["momentum"] == 0.9


def test_unknown_type():
    with pytest.raises(ValueError, match=r"optimizer.type 'Lamb' is not a known.*AdamW.*Lion.*SGD"):
        build_optimizer("Lamb", {}, [flat_param()])
    with pytest.raises(ValueError, match=r"optimizer.type 'LBFGS' is not supported: .*closure"):
        build_optimizer("LBFGS", {}, [flat_param()])


def test_bad_params():
    with pytest.raises(ValueError, match=r"optimizer.params.weight_decy .*'weight_decay'"):
        build_optimizer("Adam", {"weight_decy": 0.1}, [flat_param()])
    with pytest.raises(ValueError, match=r"optimizer.params.betas2 is not a parameter of SGD"):
        build_optimizer("SGD", {"betas2": 0.1}, [flat_param()])
    with pytest.raises(ValueError, match=r"optimizer.params.bias_correction=false"):
        build_optimizer("Adam", {"bias_correction": False}, [flat_param()])
    with pytest.raises(ValueError, match=r"max_grad_norm.*gradient_clipping"):
        build_optimizer("Adam", {"max_grad_norm": 1.0}, [flat_param()])
    with pytest.raises(
        ValueError, match=r"optimizer.params for 'SGD' rejected by SGD: .*learning rate"
    ):
        build_optimizer("SGD", {"lr": -1.0}, [flat_param()])
