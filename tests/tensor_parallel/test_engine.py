"""Tensor parallelism inside the engine: TP 2 x DP 2 on 4 processes, ZeRO stages 0-3, against
one dense process on the global batch (the demo GPT with its tied embedding, AdamW, clipping,
accumulation): parameters within 1e-5 after several steps, the same global gradient norm, and
the tensor group's first-step input check."""

from __future__ import annotations

import pytest
import torch

import zerolap
import zerolap.comm as dist
from zerolap.demo.gpt import GPT, GPTConfig, synthetic_batch

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=4, d_model=16)
STEPS, MICRO, LR, CLIP = 3, 2, 0.01, 0.05


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def dense_reference(gas: int, data: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    norms = []
    for step in range(STEPS):
        tokens, targets = synthetic_batch(CFG, MICRO * gas * data, seed=step)
        opt.zero_grad()
        model(tokens, targets).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _config(stage: int, gas: int, tensor: int, overlap: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 500,
            "stage3_param_persistence_threshold": 0,
        },
        "tensor_parallel": {"autotp_size": tensor, "overlap": overlap},
    }


def train_tp(stage: int, gas: int, tensor: int, overlap: str):
    engine, *_ = zerolap.initialize(model=_model(), config=_config(stage, gas, tensor, overlap))
    data, data_rank = engine.dp_world_size, engine.get_data_parallel_rank()
    norms = []
    for step in range(STEPS):
        tokens, targets = synthetic_batch(CFG, MICRO * gas * data, seed=step)
        for micro in range(gas):
            lo = (micro * data + data_rank) * MICRO
            loss = engine(tokens[lo : lo + MICRO], targets[lo : lo + MICRO])
            engine.backward(loss)
            engine.step()
        norms.append(engine.get_global_grad_norm())
    params = list(engine.module.named_parameters())
    with zerolap.zero.GatheredParameters([p for _, p in params]):
        got = {n: p.detach().clone() for n, p in params}
    splits = {n: getattr(p, "tp_split", None) for n, p in params}
    engine.destroy()
    return got, splits, norms


def check_parity(stage: int, gas: int, tensor: int, overlap: str) -> str | None:
    got, splits, norms = train_tp(stage, gas, tensor, overlap)
    want, want_norms = dense_reference(gas, dist.get_world_size() // tensor)
    for name, value in got.items():
        expected = want[name] if splits[name] is None else splits[name].take(want[name])
        worst = (value - expected).abs().max().item()
        if worst > 1e-5:
            return f"rank {dist.get_rank()}: {name} differs by {worst:.2e}"
    for got_norm, want_norm in zip(norms, want_norms, strict=True):
        if abs(got_norm - want_norm) > 1e-5 * want_norm:
            return f"rank {dist.get_rank()}: grad norm {got_norm} vs dense {want_norm}"
    return None


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tp2_dp2_equals_dense(ranks, stage):
    full = "full" if stage < 3 else "backward"  # full overlap and stage 3 are refused
    for gas, overlap in ((1, full), (2, "off")):
        results = ranks(4).run(check_parity, stage, gas, 2, overlap, timeout=240)
        assert results == [None] * 4, results


def test_tp4_alone_equals_dense(ranks):
    results = ranks(4).run(check_parity, 2, 2, 4, "backward", timeout=240)
    assert results == [None] * 4, results


def feed_different_batches() -> str:
    engine, *_ = zerolap.initialize(model=_model(), config=_config(1, 1, 2, "off"))
    tokens, targets = synthetic_batch(CFG, MICRO, seed=dist.get_rank())  # wrong: per rank
    try:
        engine(tokens, targets)
    except ValueError as err:
        return str(err)
    finally:
        engine.destroy()
    return "no error"


def test_tensor_ranks_fed_different_batches_is_named(ranks):
    messages = ranks(2).run(feed_different_batches)
    for message in messages:
        assert "tensor group [0, 1]" in message and "different inputs" in message


def inf_on_one_tensor_rank() -> tuple[bool, float, bool]:
    """An inf in the gradient of a replicated parameter (the final norm's weight) on tensor
    rank 1 only, which rank 0 counts in the norm for both."""
    engine, *_ = zerolap.initialize(model=_model(), config=_config(1, 1, 2, "off"))
    weight = engine.module.ln_f.weight
    weight.register_hook(lambda g: torch.full_like(g, float("inf")) if dist.get_rank() else g)
    before = weight.detach().clone()
    tokens, targets = synthetic_batch(CFG, MICRO, seed=0)
    engine.backward(engine(tokens, targets))
    engine.step()
    result = (engine.was_step_applied(), engine.get_global_grad_norm(), torch.equal(weight, before))
    engine.destroy()
    return result


def test_an_inf_in_a_replicated_gradient_on_one_tensor_rank_skips_the_step(ranks):
    # The norm says inf, as it does for an inf in a split parameter (it said nan when the run
    # a rank does not count was multiplied by 0).
    for applied, norm, unchanged in ranks(2).run(inf_on_one_tensor_rank):
        assert not applied and norm == float("inf") and unchanged


def tp_wire_bytes(overlap: str) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes all-reduced over the tensor group in one training step of pure TP 2, per pass,
    against the formula: per block 2 forward (attention and MLP outputs) and 2 backward (their
    input gradients) all-reduces of b*s*h, plus the vocab-parallel ends (embedding forward and
    the loss's max and sums, 3*b*s floats; the head's input gradient backward). Splitting the
    micro-batch in two lanes moves the same bytes in twice as many all-reduces."""
    from zerolap.comm.logger import COMMS_LOGGER
    from zerolap.tensor_parallel.mappings import BACKWARD, FORWARD

    config = _config(0, 1, 2, overlap) | {"comms_logger": {"enabled": True, "prof_all": True}}
    engine, *_ = zerolap.initialize(model=_model(), config=config)
    tokens, targets = synthetic_batch(CFG, MICRO, seed=0)
    engine(tokens, targets)  # the first forward's input check, outside the count
    COMMS_LOGGER.reset()
    engine.backward(engine(tokens, targets))
    engine.step()
    measured = {
        kind: sum(r.message_bytes for r in COMMS_LOGGER.records if r.op == kind)
        for kind in (FORWARD, BACKWARD)
    }
    measured["count"] = sum(r.op == FORWARD for r in COMMS_LOGGER.records)
    dist.configure(enabled=False)
    engine.destroy()
    activation = MICRO * CFG.seq_len * CFG.d_model * 4
    lanes = 2 if overlap == "full" else 1
    expected = {
        FORWARD: (2 * CFG.n_layer + 1) * activation + 3 * MICRO * CFG.seq_len * 4,
        BACKWARD: (2 * CFG.n_layer + 1) * activation,
        "count": 2 * CFG.n_layer * lanes + 3,
    }
    return measured, expected


@pytest.mark.parametrize("overlap", ["backward", "full"])
def test_tensor_parallel_wire_bytes_match_formula(ranks, overlap):
    for measured, expected in ranks(2).run(tp_wire_bytes, overlap):
        assert measured["count"] == expected["count"], (measured, expected)
        for kind, want in expected.items():
            assert abs(measured[kind] - want) <= 0.01 * want, (kind, measured, expected)
