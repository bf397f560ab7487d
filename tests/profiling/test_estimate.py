"""The memory estimator against the ZeRO paper's Table 1 and zerolap's fp32 accounting."""

from __future__ import annotations

import pytest

from zerolap.profiling.estimate import Placement, estimate_model_states, estimate_offload


def test_paper_table_1_for_7_5b_parameters_on_64_ranks():
    gb = {stage: b / 1e9 for stage, b in estimate_model_states(7.5e9, 64, "mixed").items()}
    assert gb[0] == pytest.approx(120, abs=0.05)
    assert gb[1] == pytest.approx(31.4, abs=0.05)
    assert gb[2] == pytest.approx(16.6, abs=0.05)
    assert gb[3] == pytest.approx(1.88, abs=0.01)


def test_fp32_matches_the_engine_formulas():
    per_param = estimate_model_states(1, 4, "fp32")
    assert per_param == {0: 16, 1: 8 + 8 / 4, 2: 4 + 12 / 4, 3: 16 / 4}


@pytest.mark.parametrize(
    ("numel", "world", "precision", "message"),
    [
        (0, 4, "mixed", "must be positive"),
        (10, 0, "mixed", "world size must be >= 1"),
        (10, 4, "fp8", "precision must be one of"),
    ],
)
def test_bad_input_is_named(numel, world, precision, message):
    with pytest.raises(ValueError, match=message):
        estimate_model_states(numel, world, precision)


def test_offload_moves_the_optimizer_share_and_at_stage_3_the_parameters():
    n = 4
    fp32 = estimate_offload(1, n, "fp32")  # p = g = 4, m = 0, k = 8
    assert set(fp32[0]) == {"none"}  # nothing to offload without a partitioned optimizer
    # From an accelerator the host steps an fp32 master (4 B), unless it holds the shard itself.
    assert fp32[1]["cpu"] == Placement(device=4 + 4, host=(4 + 8) / n)
    assert fp32[2]["nvme"] == Placement(device=4, host=4 / n, disk=(4 + 8) / n)
    assert fp32[3]["nvme"] == Placement(device=0, host=4 / n, disk=(4 + 4 + 8) / n)
    assert fp32[3]["cpu"] == Placement(device=0, host=(4 + 4 + 8) / n)
    mixed = estimate_offload(7.5e9, 64, "mixed")
    for stage in (1, 2, 3):
        for tier in ("cpu", "nvme"):
            placed = mixed[stage][tier]
            total = placed.device + placed.host + placed.disk
            assert total == pytest.approx(mixed[stage]["none"].device)
    # Stage 2: master, moments and the gradient shard on the host, the bf16 weights stay.
    assert mixed[2]["cpu"] == Placement(device=7.5e9 * 2, host=7.5e9 * 14 / 64)


def test_bf16_masters_keep_no_master_and_half_the_moments():
    n = 4
    placed = estimate_offload(1, n, "bf16-masters")  # p = g = 2, m = 0, k = 4
    assert placed[0] == {}  # a ZeRO optimizer's: stages 1-3
    assert placed[1] == {"none": Placement(device=2 + 2 + 4 / n)}
    assert placed[2] == {"none": Placement(device=2 + (2 + 4) / n)}
    assert placed[3] == {"none": Placement(device=(2 + 2 + 4) / n)}  # no offload columns
