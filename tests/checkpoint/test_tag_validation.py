"""ds_config's ``checkpoint.tag_validation``: ranks given different tags save one checkpoint
under rank 0's tag (with a warning, or silently), or fail alike on every rank, leaving the last
good checkpoint as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.logs import captured_logs
from zerolap.checkpoint import CheckpointError


def check_tags(root: str, validation: str | None) -> dict:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2},
    }
    if validation is not None:
        config["checkpoint"] = {"tag_validation": validation}
    engine, *_ = zerolap.initialize(model=torch.nn.Linear(4, 2), config=config)
    rank = dist.get_rank()
    engine.backward(engine(torch.randn(2, 4)).pow(2).sum())
    engine.step()
    engine.save_checkpoint(root, tag="good")
    saved = [p.detach().clone() for p in engine.module.parameters()]
    engine.backward(engine(torch.randn(2, 4)).pow(2).sum())
    engine.step()
    error = None
    with captured_logs() as logs:
        try:
            engine.save_checkpoint(root, tag=f"step-on-rank-{rank}")
        except CheckpointError as caught:
            error = str(caught)
    engine.load_checkpoint(root, tag="good")  # the last good checkpoint loads as saved
    params = engine.module.parameters()
    restored = all(torch.equal(a, b) for a, b in zip(saved, params, strict=True))
    return {
        "error": error,
        "warned": [line for line in logs if "different tags" in line],
        "restored": restored,
        "folders": sorted(p.name for p in Path(root).iterdir() if p.is_dir()),
    }


@pytest.mark.parametrize("validation", [None, "Ignore", "fail"])
def test_different_tags(ranks, tmp_path, validation):
    results = ranks(2).run(check_tags, str(tmp_path), validation)
    for rank, result in enumerate(results):
        assert result["restored"]
        if validation == "fail":
            assert "rank 0 'step-on-rank-0', rank 1 'step-on-rank-1'" in result["error"]
            assert result["folders"] == ["good"]
        else:
            assert result["error"] is None
            assert result["folders"] == ["good", "step-on-rank-0"]  # rank 0's tag for both
            # Warned once, by rank 0, unless ignored (the default is "Warn").
            assert len(result["warned"]) == (validation is None and rank == 0)
    if validation != "fail":  # the checkpoint under rank 0's tag is whole: it consolidates
        from zerolap.checkpoint import get_fp32_state_dict

        assert set(get_fp32_state_dict(str(tmp_path), tag="step-on-rank-0")) == {"weight", "bias"}
