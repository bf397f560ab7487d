"""``deepspeed.moe.layer.MoE`` on zerolap: the gates route as DeepSpeed's formulas say, the
layer's output and gradients equal a token-by-token computation, and a model with MoE layers
trains at ZeRO stages 0-3 on 2 ranks exactly as one process does."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import zerolap
import zerolap.comm as dist
from zerolap.moe.gating import TopKGate, capacity, top1gating, top2gating, topkgating
from zerolap.moe.layer import MoE
from zerolap.moe.utils import split_params_into_different_moe_groups_for_optimizer
from zerolap.zero import GatheredParameters

TIMEOUT = 120.0


def _logits(choices: list[int], experts: int, strength: float = 3.0) -> torch.Tensor:
    """Token s prefers expert ``choices[s]``; its second choice is the next expert round."""
    logits = torch.zeros(len(choices), experts)
    for s, e in enumerate(choices):
        logits[s, e] = strength + 0.01 * s
        logits[s, (e + 1) % experts] = 1.0
    return logits


def _slots(combine: torch.Tensor) -> dict[tuple[int, int], int]:
    """(token, expert) -> the slot it takes."""
    return {(s, e): c for s, e, c in combine.nonzero().tolist()}


def test_capacity_is_the_even_share_times_the_factor_at_least_the_minimum():
    assert capacity(10, 4, 1.0, 0) == 3  # ceil(2.5)
    assert capacity(10, 4, 2.0, 0) == 5
    assert capacity(10, 4, 1.0, 4) == 4


def test_top1_keeps_the_first_tokens_up_to_capacity_and_weights_by_probability():
    logits = _logits([0, 0, 1, 0, 0, 1], experts=2)
    l_aux, combine, dispatch, counts = top1gating(logits, 1.0, 0, use_rts=False)
    gates = F.softmax(logits, dim=1)
    assert counts.tolist() == [4, 2]
    # capacity ceil(6 / 2) = 3: expert 0 keeps tokens 0, 1, 3 (slots 0-2) and drops token 4.
    assert _slots(combine) == {(0, 0): 0, (1, 0): 1, (3, 0): 2, (2, 1): 0, (5, 1): 1}
    assert combine.shape == (6, 2, 3) and torch.equal(dispatch, combine.bool())
    for (s, e), c in _slots(combine).items():
        assert combine[s, e, c] == gates[s, e]  # top-1 keeps the raw probability
    first = F.one_hot(torch.tensor([0, 0, 1, 0, 0, 1]), 2).float()
    expected = 2 * torch.sum(gates.mean(0) * first.mean(0))
    torch.testing.assert_close(l_aux, expected, rtol=0, atol=0)


def test_top1_random_selection_keeps_capacity_tokens_in_token_order():
    logits = _logits([0] * 7 + [1], experts=2)
    chosen = set()
    for seed in range(8):
        torch.manual_seed(seed)
        _, combine, _, counts = top1gating(logits, 1.0, 0, use_rts=True)
        kept = sorted(s for (s, e) in _slots(combine) if e == 0)
        assert counts.tolist() == [7, 1] and len(kept) == 4  # capacity ceil(8 / 2)
        assert [_slots(combine)[(s, 0)] for s in kept] == [0, 1, 2, 3]
        chosen.add(tuple(kept))
    assert len(chosen) > 1  # random, not the first four


def test_noise_and_capacity_follow_the_mode():
    torch.manual_seed(0)
    tokens = torch.randn(64, 8)
    for policy in ("RSample", "Jitter"):
        gate = TopKGate(8, 4, k=1, noisy_gate_policy=policy, min_capacity=64, use_rts=False)
        plain = top1gating(gate.wg(tokens), 1.0, 64, use_rts=False)[1]
        assert not torch.equal(gate(tokens)[1], plain)  # training: noisy choices or weights
        gate.eval()
        assert torch.equal(gate(tokens)[1], plain)  # evaluation: none
    gate = TopKGate(8, 4, capacity_factor=1.0, eval_capacity_factor=2.0, min_capacity=0)
    assert gate(tokens)[1].shape[2] == 16  # 64 / 4 x 1.0
    assert gate.eval()(tokens)[1].shape[2] == 32  # x 2.0


def test_top2_samples_only_the_second_expert():
    torch.manual_seed(0)
    logits = torch.randn(256, 4) * 0.1
    first = F.softmax(logits, dim=1).argmax(dim=1)
    deterministic = top2gating(logits, 4.0, 0, top2_2nd_expert_sampling=False)[1].sum(2)
    sampled = top2gating(logits.clone(), 4.0, 0, top2_2nd_expert_sampling=True)[1].sum(2)
    for weights in (deterministic, sampled):
        assert torch.all(weights[torch.arange(256), first] > 0)
        assert torch.equal((weights > 0).sum(1), torch.full((256,), 2))
    assert not torch.equal(deterministic > 0, sampled > 0)


def test_top1_without_dropping_grows_capacity_and_masks_unused_tokens():
    logits = _logits([0, 0, 0, 1], experts=2)
    _, combine, _, counts = top1gating(logits, 1.0, 0, drop_tokens=False, use_rts=False)
    assert combine.shape[2] == 3 and len(_slots(combine)) == 4
    used = torch.tensor([1, 0, 1, 1])
    _, combine, _, counts = top1gating(logits, 1.0, 0, used_token=used, use_rts=False)
    assert counts.tolist() == [2, 1] and (1, 0) not in _slots(combine)


def test_top2_renormalises_and_queues_second_choices_after_first_ones():
    logits = _logits([0, 1, 0, 2], experts=3)
    _, combine, _, counts = top2gating(logits, 1.0, 0, top2_2nd_expert_sampling=False)
    gates = F.softmax(logits, dim=1)
    # Firsts: 0 -> e0, 1 -> e1, 2 -> e0, 3 -> e2; seconds: e1, e2, e1, e0.
    assert counts.tolist() == [3, 3, 2] and combine.shape[2] == 3  # ceil(2 x 4 / 3) slots
    # e0 holds tokens 0 and 2, then token 3's second choice.
    assert _slots(combine) == {
        (0, 0): 0, (2, 0): 1, (3, 0): 2,
        (1, 1): 0, (0, 1): 1, (2, 1): 2,
        (3, 2): 0, (1, 2): 1,
    }  # fmt: skip
    weights = combine.sum(dim=2)
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(4))
    torch.testing.assert_close(weights[0, 0] / weights[0, 1], gates[0, 0] / gates[0, 1])
    # At capacity 1 only first choices fit, each then with weight 1.
    _, combine, _, _ = top2gating(logits, 1 / 6, 1, top2_2nd_expert_sampling=False)
    assert _slots(combine) == {(0, 0): 0, (1, 1): 0, (3, 2): 0}
    assert all(combine[s, e, c] == 1 for (s, e), c in _slots(combine).items())


def test_topk_probs_policy_keeps_the_strongest_choices():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 3.0, 2.0, 1.0], [1.0, 0.0, 3.0, 2.0]])
    l_aux, combine, _, counts = topkgating(logits, 3, 1 / 3, 1)  # capacity max(ceil(3/4), 1)
    gates = F.softmax(logits, dim=1)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 1, 1]])
    assert counts.tolist() == mask.sum(0).tolist()
    strongest = {e: int((gates * mask)[:, e].argmax()) for e in range(4)}
    assert {(s, e) for (s, e) in _slots(combine)} == {(s, e) for e, s in strongest.items()}
    expected = torch.sum(gates.mean(0) * mask.float().mean(0)) * 4 / 3
    torch.testing.assert_close(l_aux, expected)
    with pytest.raises(ValueError, match="drop_policy='last'"):
        topkgating(logits, 3, 1.0, 1, drop_policy="last")
    # position: each expert keeps its first token; no dropping: room for every choice.
    _, combine, _, _ = topkgating(logits, 3, 1 / 3, 1, drop_policy="position")
    assert set(_slots(combine)) == {(0, 0), (0, 1), (0, 2), (1, 3)}
    _, combine, _, _ = topkgating(logits, 3, 1 / 3, 1, drop_tokens=False)
    assert combine.shape[2] == 3 and len(_slots(combine)) == 9
    torch.testing.assert_close(combine.sum(dim=(1, 2)), torch.ones(3))  # weights sum to 1


class Expert(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize(("k", "residual"), [(1, False), (1, True), (2, False), (3, False)])
def test_layer_equals_a_token_by_token_computation(k, residual):
    torch.manual_seed(0)
    layer = MoE(8, Expert(8), num_experts=4, k=k, min_capacity=0, use_residual=residual)
    layer.deepspeed_moe.gate.top2_2nd_expert_sampling = False
    layer.deepspeed_moe.gate.use_rts = False
    x = torch.randn(3, 5, 8, requires_grad=True)
    out, l_aux, counts = layer(x)
    combine = layer.deepspeed_moe.gate(x.reshape(-1, 8))[1]
    weights = combine.sum(dim=2)  # the gate's weight of each (token, expert) it kept
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    tokens = x.reshape(-1, 8)
    rows = []
    for s in range(tokens.shape[0]):
        row = sum(weights[s, e] * experts[e](tokens[s]) for e in range(4) if weights[s, e] != 0)
        rows.append(row if torch.is_tensor(row) else torch.zeros(8))
    expected = torch.stack(rows).reshape(x.shape)
    if residual:
        mix = torch.softmax(layer.coefficient(x), dim=-1)
        expected = expected * mix[..., :1] + layer.mlp(x) * mix[..., 1:]
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert counts.sum() == 15 * k and l_aux.ndim == 0
    # Gradients too: the layer's (with l_aux) against the token-by-token one's.
    params = [x, *layer.parameters()]
    ours = torch.autograd.grad(
        out.square().sum() + l_aux, params, allow_unused=True, retain_graph=True
    )
    theirs = torch.autograd.grad((expected.square().sum() + l_aux), params, allow_unused=True)
    for param, a, b in zip(params, ours, theirs, strict=True):
        # An expert no token reached: zero gradients here, none there.
        a = torch.zeros_like(param) if a is None else a
        b = torch.zeros_like(param) if b is None else b
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_used_token_and_16_bit_inputs():
    torch.manual_seed(0)
    layer = MoE(8, Expert(8), num_experts=2, min_capacity=8, use_rts=False)
    low_layer = copy.deepcopy(layer).to(torch.bfloat16)
    x = torch.randn(2, 4, 8)
    used = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1])
    out, _, counts = layer(x, used)
    assert counts.sum() == 6 and torch.all(out.reshape(-1, 8)[used == 0] == 0)
    assert torch.all(out.reshape(-1, 8)[used == 1] != 0)
    low, _, _ = low_layer(x.to(torch.bfloat16))
    assert low.dtype == torch.bfloat16  # the gate runs in fp32, the experts in bf16
    torch.testing.assert_close(low.float(), layer(x)[0], rtol=0.05, atol=0.02)


def test_experts_are_marked_for_their_own_optimizer_groups():
    layer = MoE(8, Expert(8), num_experts=2)
    names = {n for n, p in layer.named_parameters() if getattr(p, "allreduce", True) is False}
    assert names == {
        f"deepspeed_moe.experts.deepspeed_experts.{i}.{part}.{kind}"
        for i in range(2)
        for part in ("up", "down")
        for kind in ("weight", "bias")
    }
    assert {p.group_name for n, p in layer.named_parameters() if n in names} == {"ep_size_1"}
    assert "deepspeed_moe.gate.wg.weight" in dict(layer.named_parameters())


def test_what_zerolap_does_not_run_is_refused_by_name():
    with pytest.raises(RuntimeError, match=r"ep_size=2 run before zerolap\.initialize"):
        MoE(8, Expert(8), num_experts=4, ep_size=2)(torch.zeros(3, 8))
    with pytest.raises(ValueError, match="num_experts=3 must be a multiple of ep_size=2"):
        MoE(8, Expert(8), num_experts=3, ep_size=2)
    with pytest.raises(NotImplementedError, match="enable_expert_tensor_parallelism"):
        MoE(8, Expert(8), num_experts=2, enable_expert_tensor_parallelism=True)
    with pytest.raises(ValueError, match="noisy_gate_policy='Gauss'"):
        TopKGate(8, 2, noisy_gate_policy="Gauss")
    with pytest.raises(ValueError, match="'RSample' applies to top-1"):
        TopKGate(8, 2, k=2, noisy_gate_policy="RSample")
    with pytest.raises(ValueError, match="k=3: a token picks between 1 and num_experts=2"):
        TopKGate(8, 2, k=3)


# -- training through the engine -------------------------------------------------------------

VOCAB, WIDTH, SEQ, MICRO, GAS = 16, 8, 6, 2, 2


class MoEModel(torch.nn.Module):
    """Embedding, a residual top-1 MoE, a top-2 MoE, a head; returns the loss with 0.01 x the
    layers' balance losses."""

    def __init__(self, ep_size: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.moe1 = MoE(WIDTH, Expert(WIDTH), 4, ep_size, k=1, use_rts=False, use_residual=True)
        self.moe2 = MoE(WIDTH, Expert(WIDTH), 4, ep_size, k=2, top2_2nd_expert_sampling=False)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        out, aux1, _ = self.moe1(h)
        h = h + out
        out, aux2, _ = self.moe2(h)
        h = h + out
        loss = F.cross_entropy(self.head(h).reshape(-1, VOCAB), targets.reshape(-1))
        return loss + 0.01 * (aux1 + aux2)


def _batch(step: int, size: int):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (size, SEQ), generator=g), torch.randint(
        0, VOCAB, (size, SEQ), generator=g
    )


def _groups(model):
    return split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "weight_decay": 0.01}
    )


def _reference(steps: int, world: int) -> list[torch.Tensor]:
    """One process: each rank's micro-batches routed as that rank routes them (a gate's capacity
    is per call), gradients averaged over them all."""
    model = MoEModel()
    optimizer = torch.optim.AdamW(_groups(model), lr=0.02)
    for step in range(steps):
        tokens, targets = _batch(step, MICRO * GAS * world)
        optimizer.zero_grad()
        for part in range(GAS * world):
            mine = slice(part * MICRO, (part + 1) * MICRO)
            (model(tokens[mine], targets[mine]) / (GAS * world)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def train_moe(stage: int, built_sharded: bool) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    if stage == 3:  # every parameter sharded, the gates' and experts' too
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if built_sharded:  # the experts copied from an expert whose children are sharded already
        with zerolap.zero.Init(config_dict_or_path=config):
            model = MoEModel()
    else:
        model = MoEModel()
    optimizer = torch.optim.AdamW(_groups(model), lr=0.02)
    engine, *_ = zerolap.initialize(model=model, optimizer=optimizer, config=config)
    for step in range(3):
        tokens, targets = _batch(step, MICRO * GAS * world)
        for micro in range(GAS):
            part = micro * world + rank  # the reference's order does not matter: a sum
            mine = slice(part * MICRO, (part + 1) * MICRO)
            engine.backward(engine(tokens[mine], targets[mine]))
            engine.step()
    params = list(model.parameters())
    with GatheredParameters(params):
        trained = [p.detach().clone() for p in params]
    return max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(trained, _reference(3, world), strict=True)
    )


@pytest.mark.parametrize(
    ("stage", "built_sharded"), [(0, False), (1, False), (2, False), (3, False), (3, True)]
)
def test_a_moe_model_trains_as_one_process(ranks, stage, built_sharded):
    for difference in ranks(2).run(train_moe, stage, built_sharded, timeout=TIMEOUT):
        assert difference < 1e-5
