"""``zero_optimization.stage3_module_granularity_threshold``: which modules DeepSpeed's measure
makes leaves (gathered whole with their subtree), and training with them: the same parameters
as without, with fewer units fetched."""

from __future__ import annotations

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.config.helpers import load_error
from tests.logs import captured_logs
from zerolap.zero import GatheredParameters, Init, leaf_modules
from zerolap.zero.leaf_modules import granularities, mark_leaves_by_granularity, z3_leaf_module

TIMEOUT = 90.0
MICRO, STEPS = 2, 3
KEY = "stage3_module_granularity_threshold"


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(8, 8)  # 72 elements
        self.o = torch.nn.Linear(8, 8)  # 72

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.o(torch.tanh(self.q(h)))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(8)  # 16
        self.attn = Attention()  # 144 over 3 modules: 48
        # A container: its two Linears count, it and the GELU do not.
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)
        )  # 288 + 264

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln(h))
        return h + self.mlp(h)  # the block: 712 elements over 7 modules, 101


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(100, 8)  # 800, no children: never a leaf of its own
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.act = torch.nn.Tanh()  # no parameters: counts nothing
        self.head = torch.nn.Linear(8, 1)  # 9

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.act(h)).mean(dim=1)  # the model: 2233 over 17 modules, 131


def model() -> Model:
    torch.manual_seed(0)
    return Model()


def test_granularity_is_deepspeeds_measure():
    m = model()
    want = {m.blocks[0].attn: 48, m.blocks[1].attn: 48, m.blocks[0]: 101, m.blocks[1]: 101, m: 131}
    assert granularities(m) == want


@pytest.mark.parametrize(
    ("threshold", "leaves"),
    [
        (47, []),
        (48, ["blocks.0.attn", "blocks.1.attn"]),
        (101, ["blocks.0", "blocks.1"]),  # outermost first: the attention inside is not marked
        (10**6, ["blocks.0", "blocks.1"]),  # the model qualifies but is never a leaf
    ],
)
def test_the_outermost_modules_at_or_under_the_threshold_become_leaves(threshold, leaves):
    m = model()
    marked, _ = mark_leaves_by_granularity(m, threshold)
    names = {module: name for name, module in m.named_modules()}
    assert [names[module] for module in marked] == leaves
    assert sorted(name for name, module in m.named_modules() if z3_leaf_module(module)) == leaves


def test_a_subtree_over_the_leaf_bound_is_never_a_leaf(monkeypatch):
    monkeypatch.setattr(leaf_modules, "MAX_LEAF_NUMEL", 700)  # a block holds 712 elements
    m = model()
    assert m.blocks[0] not in granularities(m)
    marked, _ = mark_leaves_by_granularity(m, 101)
    assert marked == [m.blocks[0].attn, m.blocks[1].attn]


def test_a_negative_threshold_is_refused_by_name():
    message = load_error({"zero_optimization": {"stage": 3, KEY: -1}})
    assert "zero_optimization.stage3_module_granularity_threshold" in message


def _config(threshold: int) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, KEY: threshold}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
        "zero_optimization": zero,
    }


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 100, (MICRO * 2, 5), generator=g), torch.randn(
        MICRO * 2, 1, generator=g
    )


def train(threshold: int) -> dict:
    m = model()
    with captured_logs() as logs:
        engine, *_ = zerolap.initialize(model=m, config=_config(threshold))
    rank = dist.get_rank()
    for step in range(STEPS):
        tokens, targets = (t[rank * MICRO : (rank + 1) * MICRO] for t in _batch(step))
        engine.backward(torch.nn.functional.mse_loss(engine(tokens), targets))
        engine.step()
    params = list(m.parameters())
    with GatheredParameters(params):
        whole = [p.detach().clone() for p in params]
    out = {
        "params": whole,
        "units": list(engine.units.names),
        "fetches": engine.fetch_stats()["fetches"],
        "logs": [line for line in logs if KEY in line],
    }
    engine.destroy()
    return out


def check_blocks_gathered_whole() -> dict:
    runs = {"per child": train(0), "blocks": train(101), "none qualifies": train(10)}
    with Init(config_dict_or_path=_config(101)):  # sharded as built: counted at full size
        sharded = Model()
    names = {module: name for name, module in sharded.named_modules()}
    measured = {names[module]: g for module, g in granularities(sharded).items()}
    return {"rank": dist.get_rank(), "sharded": measured, **runs}


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def reference() -> list[torch.Tensor]:
    """One process on the global batch: the mean of the ranks' losses."""
    m = model()
    optimizer = torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.0)
    for step in range(STEPS):
        tokens, targets = _batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(m(tokens), targets).backward()
        optimizer.step()
    return [p.detach().clone() for p in m.parameters()]


def test_blocks_gathered_whole_train_to_the_same_parameters(ranks):
    reference_params = reference()
    for result in ranks(2).run(check_blocks_gathered_whole, timeout=TIMEOUT):
        per_child, blocks, none = result["per child"], result["blocks"], result["none qualifies"]
        # Other buckets: the fused Adam kernel's vector body and tail split them elsewhere,
        # one rounding apart.
        assert _diff(blocks["params"], per_child["params"]) <= 1e-6
        assert _diff(per_child["params"], reference_params) < 1e-5
        assert all(
            torch.equal(a, b) for a, b in zip(none["params"], per_child["params"], strict=True)
        )
        assert none["units"] == per_child["units"]
        assert result["sharded"] == {
            "blocks.0.attn": 48, "blocks.0": 101, "blocks.1.attn": 48, "blocks.1": 101, "": 131
        }  # fmt: skip
        assert "blocks.0.attn.q" in per_child["units"]
        assert "blocks.0" in blocks["units"]
        assert not any(unit.startswith("blocks.0.") for unit in blocks["units"])
        # Units: emb, the head, and per block ln, q, o and the two Linears, or the block whole;
        # each fetched before its forward and again before its backward.
        assert per_child["fetches"] == STEPS * 2 * (2 + 2 * 5)
        assert blocks["fetches"] == STEPS * 2 * (2 + 2)
        assert per_child["logs"] == []
        if result["rank"] == 0:
            assert len(blocks["logs"]) == 1
            assert "2 modules gathered whole" in blocks["logs"][0]
            assert "'blocks.0' (101), 'blocks.1' (101)" in blocks["logs"][0]
            assert none["logs"] == [
                f"WARNING: [Rank 0] zero_optimization.{KEY} 10 groups no module: the finest "
                "is 'blocks.0.attn' with 48 elements per module; a threshold at least that "
                "groups it"
            ]
        else:
            assert blocks["logs"] == none["logs"] == []


class Mlp(torch.nn.Sequential):
    """A subclass of a container: code of its own, so a module (DeepSpeed tells containers by
    their class name)."""


def test_a_container_subclass_counts_as_a_module():
    block = Block()
    block.mlp = Mlp(*block.mlp)
    sizes = granularities(block)
    assert sizes[block.mlp] == (288 + 264) // 3  # its two Linears and itself
    assert sizes[block] == 712 // 8


def _llama():
    from transformers import AutoModelForCausalLM

    from tests.clients.hf_trainer import tiny_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama"))


def llama_losses(threshold: int) -> dict:
    """A Hugging Face Llama (2 decoder layers) at stage 3: three steps' losses, and the units."""
    from tests.clients.hf_trainer import VOCAB

    engine, *_ = zerolap.initialize(model=_llama(), config=_config(threshold))
    rank, losses = dist.get_rank(), []
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (MICRO * 2, 8), generator=torch.Generator().manual_seed(step))
        mine = ids[rank * MICRO : (rank + 1) * MICRO]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out = {"losses": losses, "units": list(engine.units.names)}
    engine.destroy()
    return out


def check_llama() -> list[dict]:
    """Per layer, then with the threshold at a decoder layer's granularity."""
    model = _llama()
    return [llama_losses(0), llama_losses(granularities(model)[model.model.layers[0]])]


def test_a_hugging_face_llama_gathers_its_decoder_layers_whole(ranks):
    pytest.importorskip("transformers")
    for per_child, layers in ranks(2).run(check_llama, timeout=TIMEOUT):
        assert layers["units"] != per_child["units"]
        assert "model.layers.0" in layers["units"]
        assert not any(u.startswith("model.layers.0.") for u in layers["units"])
        for got, want in zip(layers["losses"], per_child["losses"], strict=True):
            assert abs(got - want) <= 1e-6 * abs(want)
