"""An Accelerate loop with ``DeepSpeedPlugin`` on zerolap: Accelerate decides the accumulation
boundary (``set_gradient_accumulation_boundary`` before every backward, ``step()`` at the
boundary only) and reads the gradient norm back. Losses and norms equal the same loop without
DeepSpeed (plain DDP with ``clip_grad_norm_``) within 1e-5."""

from __future__ import annotations

import functools

import pytest

from tests.clients.launch import launch

pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    root = tmp_path_factory.mktemp("accelerate")

    @functools.cache
    def run(stage: int) -> dict:
        return launch("accelerate_loop.py", root / f"{stage}.json", "--stage", str(stage))

    return run


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_an_accelerate_loop_trains_as_plain_ddp(loop, stage):
    zero, plain = loop(stage), loop(-1)
    assert len(zero["losses"]) == len(plain["losses"]) == 8
    assert max(abs(a - b) for a, b in zip(zero["losses"], plain["losses"], strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(zero["norms"], plain["norms"], strict=True)) < 1e-5
