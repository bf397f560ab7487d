"""TRL on zerolap: its ``prepare_deepspeed`` (a reference model as an engine without optimizer)
and ``unwrap_model_for_generation`` (stage 3: all parameters gathered, the fetch hooks taken off
for ``generate`` and put back through DeepSpeed's offload names), then training on the
generations. Losses, reference outputs and generated tokens equal the plain DDP run's."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.clients.launch import launch

pytest.importorskip("trl")


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from tests.clients.hf_trainer import tiny_config

    root = tmp_path_factory.mktemp("trl")
    config = tiny_config("llama")
    config.pad_token_id = 0
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "llama")

    @functools.cache
    def run(stage: int) -> dict:
        flags = ["--stage", str(stage), "--model", str(root / "llama")]
        return launch("trl_loop.py", root / f"{stage}.json", *flags)

    return run


@pytest.mark.parametrize("stage", [2, 3])
def test_trl_reference_model_and_generation(loop, stage):
    zero, plain = loop(stage), loop(-1)
    assert zero["generated"] == plain["generated"]
    for key in ("losses", "reference"):
        assert max(abs(a - b) for a, b in zip(zero[key], plain[key], strict=True)) < 1e-5
