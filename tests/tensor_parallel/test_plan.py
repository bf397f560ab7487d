"""Plans: Hugging Face GPT-2 (fused Conv1D QKV) and Llama (grouped KV heads) split by their
auto plans compute the dense model's loss and gradients; DeepSpeed's partition_config is
translated; wrong sizes are named errors that leave the model unsplit."""

from __future__ import annotations

import pytest
import torch

from zerolap.config import ConfigError, load_config
from zerolap.demo.gpt import GPT, GPTConfig
from zerolap.tensor_parallel import parallelize
from zerolap.tensor_parallel.plan import plan_from_config
from zerolap.topology import ParallelDims

VOCAB = 64


def _hf(arch: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch == "gpt2":
        config = AutoConfig.for_model(
            "gpt2", n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    else:
        config = AutoConfig.for_model(
            "llama", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
            max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    config.attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


def check_hf_equals_dense(arch: str, overlap: str) -> None:
    """Loss and gradients equal the dense model's; backward all-reduces b*s*h twice per layer
    (Llama's q/k/v, and its gate/up, read one tensor each and reduce it once), in twice as
    many calls with the lanes."""
    import zerolap.comm as dist
    from zerolap.comm.logger import COMMS_LOGGER
    from zerolap.tensor_parallel.mappings import BACKWARD

    dense, split = _hf(arch), _hf(arch)
    parallelize(split, None, overlap=overlap)
    ids = torch.randint(VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    want = dense(input_ids=ids, labels=ids, use_cache=False).loss
    want.backward()
    got = split(input_ids=ids, labels=ids, use_cache=False).loss
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)
    dist.configure(enabled=True, prof_all=True)
    COMMS_LOGGER.reset()
    got.backward()
    reduced = [r.message_bytes for r in COMMS_LOGGER.records if r.op == BACKWARD]
    dist.configure(enabled=False)
    layers, hidden = 2, 32
    assert sum(reduced) == 2 * layers * ids.numel() * hidden * 4, reduced
    assert len(reduced) == 2 * layers * (2 if overlap == "full" else 1), reduced
    dense_params = dict(dense.named_parameters())
    pieces = 0
    for name, param in split.named_parameters():
        expected = dense_params[name].grad
        if getattr(param, "tp_split", None) is not None:
            expected, pieces = param.tp_split.take(expected), pieces + 1
        torch.testing.assert_close(param.grad, expected, rtol=1e-5, atol=1e-7, msg=name)
    assert pieces == 2 * (6 if arch == "gpt2" else 7), pieces  # layers x split tensors


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("overlap", ["backward", "full"])
def test_hugging_face_models_split_by_auto_plan(ranks, arch, overlap):
    """Full overlap runs each decoder layer's two batch halves as lanes; the layers' masks and
    rotary tables are split or shared as they are per-sample or not."""
    pytest.importorskip("transformers")
    ranks(2).run(check_hf_equals_dense, arch, overlap)


def check_hf_cache() -> None:
    """Training makes an empty cache unless use_cache=False: left out, with a warning, and the
    loss unchanged. A cache holding keys cannot be split: a named error."""
    dense, model = _hf("llama"), _hf("llama")
    parallelize(model, None, overlap="full")
    ids = torch.randint(VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="without the empty DynamicCache"):
        got = model(input_ids=ids, labels=ids, use_cache=True).loss
    want = dense(input_ids=ids, labels=ids, use_cache=False).loss
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        cache = model(input_ids=ids[:, :4], use_cache=True).past_key_values
    with pytest.raises(ValueError, match=r"DynamicCache.*cannot be split.*holding keys"):
        model(input_ids=ids[:, 4:], past_key_values=cache, use_cache=True)


def test_full_overlap_and_kv_caches(ranks):
    pytest.importorskip("transformers")
    ranks(2).run(check_hf_cache)


_SHAPES = {  # each model type's own names for a 2-layer decoder of width 32 with 4 heads
    "opt": dict(num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4,
                max_position_embeddings=64, word_embed_proj_dim=32),
    "gptj": dict(n_layer=2, n_embd=32, n_head=4, n_inner=64, n_positions=64, rotary_dim=4),
    "gpt_neo": dict(num_layers=2, hidden_size=32, num_heads=4, intermediate_size=64,
                    max_position_embeddings=64, attention_types=[[["global", "local"], 1]],
                    window_size=4),
    "gpt_neox": dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64),
    "phi": dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, qk_layernorm=True),
}  # fmt: skip
_LLAMA_SHAPE = dict(
    num_hidden_layers=2, hidden_size=32, intermediate_size=64, head_dim=8,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def _tiny(model_type: str):
    """A 2-layer decoder of ``model_type`` with 4 query heads (2 key/value heads where it has
    them) of width 8, without dropout."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = _SHAPES.get(model_type, _LLAMA_SHAPE)
    config = AutoConfig.for_model(
        model_type, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0, **shape
    )
    for key, value in config.to_dict().items():  # dropout draws differ once split
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


def split_like_dense(model_types: list[str], overlap: str) -> list[str]:
    """Each model split by its auto plan against the dense one: loss, every gradient (a split
    parameter's against its slice of the dense gradient), and greedy generation. The
    mismatches found, as text."""
    import warnings

    from zerolap.tensor_parallel.plan import auto_plan

    found = []
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    for model_type in model_types:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Apertus's "no fused xIELU kernel"
            dense, split = _tiny(model_type), _tiny(model_type)
        parallelize(split, None, auto_plan(split), overlap=overlap)
        want = dense(input_ids=ids, labels=ids, use_cache=False).loss
        want.backward()
        got = split(input_ids=ids, labels=ids, use_cache=False).loss
        got.backward()
        if not torch.allclose(got, want, rtol=1e-6, atol=1e-6):
            found.append(f"{model_type}: loss {got.item()} against {want.item()}")
        grads = dict(dense.named_parameters())
        for name, param in split.named_parameters():
            expected = grads[name].grad
            if getattr(param, "tp_split", None) is not None:
                expected = param.tp_split.take(expected)
            if not torch.allclose(param.grad, expected, rtol=1e-5, atol=1e-6):
                worst = (param.grad - expected).abs().max().item()
                found.append(f"{model_type}: {name}.grad differs by {worst:.1e}")
        with torch.no_grad():
            tokens = split.generate(input_ids=ids[:, :5], max_new_tokens=5, do_sample=False)
            if not torch.equal(tokens, dense.generate(input_ids=ids[:, :5], max_new_tokens=5)):
                found.append(f"{model_type}: generated tokens differ")
    return found


def test_every_llama_style_model_type_splits_like_the_dense_model(ranks):
    """The ``model_type``s the Llama plan serves, including per-head query/key norms (Qwen3,
    Gemma 3, EXAONE 4, Hunyuan) and a learned activation (Apertus), whose replicated weights
    see only this rank's heads or columns: their gradients are summed over the group."""
    pytest.importorskip("transformers")
    from zerolap.tensor_parallel.plan import _LLAMA_STYLE

    assert ranks(2).run(split_like_dense, list(_LLAMA_STYLE), "backward", timeout=240) == [[], []]


def test_other_decoders_split_like_the_dense_model(ranks):
    """OPT, GPT-J, GPT-Neo, GPT-NeoX (each head's query, key and value rows together in one
    projection), Phi (with its per-head query/key norms) and StarCoder2, by their own plans,
    under the full overlap's lanes."""
    pytest.importorskip("transformers")
    from zerolap.tensor_parallel.plan import _OTHER_DECODERS

    assert ranks(2).run(split_like_dense, list(_OTHER_DECODERS), "full", timeout=240) == [[], []]


@pytest.mark.parametrize("model_type", ["qwen3", "apertus"])
def test_summed_weight_gradients_in_the_full_overlap_lanes(ranks, model_type):
    """The lanes hand each half's gradient to the outer backward, which sums them over the
    group once (a sum in each lane as well counted it twice)."""
    pytest.importorskip("transformers")
    assert ranks(2).run(split_like_dense, [model_type], "full") == [[], []]


def _split_error(model) -> tuple[str, bool]:
    """The error splitting ``model`` raises, and whether the model was left as it was."""
    before = [type(m) for m in model.modules()]
    try:
        parallelize(model, None)
    except ValueError as err:
        return str(err), before == [type(m) for m in model.modules()]
    return "no error", False


def split_indivisible_heads() -> tuple[str, bool]:
    torch.manual_seed(0)
    return _split_error(GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=6, d_model=24)))


def split_indivisible_layer() -> tuple[str, bool]:
    """A Llama whose MLP width (66) the 4 ranks do not divide, though its heads they do."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", num_hidden_layers=2, hidden_size=32, intermediate_size=66,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
    )  # fmt: skip
    return _split_error(AutoModelForCausalLM.from_config(config))


def test_heads_not_divisible_is_named_and_leaves_model(ranks):
    message, untouched = ranks(4).run(split_indivisible_heads)[0]
    assert "blocks.0.attn.n_head=6 is not divisible by the tensor-parallel size 4" in message
    assert untouched
    pytest.importorskip("transformers")
    message, untouched = ranks(4).run(split_indivisible_layer)[0]
    assert "66 along its split dimension, not divisible by the tensor-parallel size 4" in message
    assert "layer model.layers.0.mlp.gate_proj, a Linear" in message, message
    assert untouched


def test_tensor_size_must_divide_world():
    with pytest.raises(ValueError, match=r"tensor_parallel\.autotp_size=3 does not divide"):
        ParallelDims(4, 3)


def test_partition_config_translates_to_rules():
    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "tensor_parallel": {
                "autotp_size": 2,
                "partition_config": {
                    "use_default_specs": False,
                    "layer_specs": [
                        {
                            "patterns": [r".*\.qkv\.weight$"],
                            "partition_type": "column",
                            "shape": [3, -1],
                        },
                        {"patterns": [r".*\.proj\.weight$"], "partition_type": "row"},
                    ],
                },
            },
        },
        world_size=1,
    )
    torch.manual_seed(0)
    plan = plan_from_config(cfg.tensor_parallel, GPT(GPTConfig(64, 8, 1, 4, 16)))
    styles = {(r.style, r.parts) for r in plan.rules if r.on_weight}
    assert styles == {("colwise", 3), ("rowwise", 1)}
    assert plan.rules[0].style == "skip" and plan.rules[0].matches("lm_head")
    qkv = next(r for r in plan.rules if r.parts == 3)
    assert qkv.matches("blocks.0.attn.qkv") and not qkv.matches("blocks.0.attn.proj")


def test_layer_specs_alone_keep_the_summed_gradients_of_a_known_layout():
    """DeepSpeed's layer specs can only say column, row or skip: Qwen3's query/key norms see
    split heads whatever they split, so the plan keeps their summed gradients."""
    pytest.importorskip("transformers")
    specs = [
        {"patterns": [r".*\.(q|k|v|gate|up)_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.(o|down)_proj\.weight$"], "partition_type": "row"},
    ]
    tp = {"autotp_size": 2, "partition_config": {"use_default_specs": False, "layer_specs": specs}}
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": tp}, world_size=2)
    plan = plan_from_config(cfg.tensor_parallel, _tiny("qwen3"))
    summed = [r for r in plan.rules if r.style == "split_input"]
    assert any(r.matches("model.layers.0.self_attn.q_norm") for r in summed), plan.rules
    assert not any(r.style == "colwise" and not r.on_weight for r in plan.rules)


def test_head_counts_are_divided_on_subclasses_of_the_named_class():
    """transformers' FlashAttention2 variants subclass the attention class a plan names."""
    from zerolap.tensor_parallel.plan import TPPlan, _divide

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_heads = 4

    class FlashAttention(Attention):
        pass

    model = torch.nn.Sequential(Attention(), FlashAttention())
    _divide(model, TPPlan((), divide={"Attention": ("num_heads",)}), 2, apply=True)
    assert [m.num_heads for m in model] == [2, 2]


def split_frozen_and_per_head() -> tuple[bool, str, bool]:
    """A frozen Qwen3 splits (its norms' weights take no gradient hook) and computes the dense
    loss; a Cohere with a weight row per head in its query/key norms is refused, unsplit."""
    dense, frozen = _tiny("qwen3"), _tiny("qwen3").requires_grad_(False)
    parallelize(frozen, None)
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        same = torch.allclose(frozen(input_ids=ids).logits, dense(input_ids=ids).logits, atol=1e-5)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "cohere", use_qk_norm=True, vocab_size=VOCAB, pad_token_id=0, **_LLAMA_SHAPE
    )
    message, untouched = _split_error(AutoModelForCausalLM.from_config(config))
    return same, message, untouched


def test_frozen_norms_split_and_per_head_norm_weights_are_refused(ranks):
    pytest.importorskip("transformers")
    same, message, untouched = ranks(2).run(split_frozen_and_per_head)[0]
    assert same
    assert "q_norm (CohereLayerNorm) applies weight of shape (4, 8), a row per head" in message
    assert untouched


def test_fused_blocks_of_given_sizes_reach_the_rule():
    spec = {"patterns": [r".*\.qkv\.weight$"], "shape": [[32, 16, 16], -1]}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": [spec]}},
    }
    cfg = load_config(config, world_size=1)
    plan = plan_from_config(cfg.tensor_parallel, GPT(GPTConfig(64, 8, 1, 4, 16)))
    assert next(r for r in plan.rules if r.on_weight).parts == (32, 16, 16)


@pytest.mark.parametrize(
    "spec,key",
    [
        ({"patterns": ["x"], "shape": [-1, [1, 2, 2]]}, "shape"),
        ({"patterns": ["x"], "shape": [[4, 0], -1]}, "shape"),
        ({"patterns": ["x"], "partition_type": "row", "shape": [[8, 4, 4], -1]}, "shape"),
        ({"patterns": ["x"], "partition_type": "skip", "shape": [3, -1]}, "shape"),
        ({"patterns": ["x"], "partition_type": "row", "partition_dim": 0}, "partition_dim"),
        ({"patterns": ["x"], "partition_type": "banana"}, "partition_type"),
    ],
)
def test_unsupported_layer_spec_is_named(spec, key):
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": [spec]}},
    }
    with pytest.raises(
        ConfigError, match=rf"tensor_parallel\.partition_config\.layer_specs\[0\]\.{key}"
    ):
        load_config(config, world_size=1)


def test_batch_counted_over_every_rank_is_accepted():
    """DeepSpeed and the Trainer count the T ranks of a tensor group in train_batch_size."""
    config = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "tensor_parallel": {"autotp_size": 2},
    }
    assert load_config(config, world_size=2).train_batch_size == 8  # 2 x 2 x 2 data ranks
    config["train_batch_size"] = 8
    assert load_config(config, world_size=2).train_batch_size == 8
    config["train_batch_size"] = 12
    with pytest.raises(ConfigError, match="train_batch_size"):
        load_config(config, world_size=2)


def test_unknown_preset_is_named():
    from zerolap.tensor_parallel import preset_plan

    with pytest.raises(ValueError, match="preset_model='bloom'"):
        preset_plan("bloom")


def test_tensor_parallel_keys_without_a_size_are_said():
    config = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"tp_overlap_comm": True}}
    assert load_config(config, world_size=1).advice() == [
        "tensor_parallel.tp_overlap_comm: no effect without tensor_parallel.autotp_size > 1"
    ]


def test_overlap_choices_checked_before_training():
    base = {"train_micro_batch_size_per_gpu": 2}
    contradiction = base | {"tensor_parallel": {"overlap": "off", "tp_overlap_comm": True}}
    with pytest.raises(ConfigError, match=r"tensor_parallel\.overlap: overlap: off contradicts"):
        load_config(contradiction, world_size=2)
    full_stage3 = base | {
        "tensor_parallel": {"autotp_size": 2, "overlap": "full"},
        "zero_optimization": {"stage": 3},
    }
    with pytest.raises(ConfigError, match=r"tensor_parallel\.overlap, zero_optimization\.stage"):
        load_config(full_stage3, world_size=2)
    with pytest.raises(ConfigError, match=r"tensor_parallel\.overlap"):
        load_config(base | {"tensor_parallel": {"overlap": "sometimes"}}, world_size=2)
    backward = load_config(base | {"tensor_parallel": {"tp_overlap_comm": True}}, world_size=1)
    assert backward.tensor_parallel.overlap_mode == "backward"


def test_tp_model_init_reads_its_config():
    """The Trainer passes its ds_config to tp_model_init too: a disagreement is named."""
    from zerolap.runtime.initialize import tp_model_init

    model = torch.nn.Linear(2, 2)
    config = {"tensor_parallel": {"autotp_size": 4}}
    with pytest.raises(ConfigError, match=r"tp_size=2\) but its config has .*autotp_size=4"):
        tp_model_init(model, 2, torch.float32, config=config)
