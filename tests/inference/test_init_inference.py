"""``init_inference``: a Hugging Face GPT-2 and Llama split over 2 ranks by
``tensor_parallel.tp_size`` (and DeepSpeed's legacy ``mp_size``) give the dense model's logits
and, greedy or sampled, its generated tokens on every rank; the dtype, placement and length keys
do what they say; what zerolap cannot do is a named error before anything runs."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import zerolap
from zerolap.config import ConfigError

VOCAB = 64


def _hf(arch: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch == "gpt2":
        config = AutoConfig.for_model(
            "gpt2", n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
    else:
        config = AutoConfig.for_model(
            "llama", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
            max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _ids(count: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(1, VOCAB, (count, length), generator=torch.Generator().manual_seed(3))


def check_split_model_generates_as_dense(arch: str, legacy: bool) -> None:
    import zerolap.comm as dist

    model = _hf(arch)
    dense = copy.deepcopy(model)
    torch.manual_seed(100 + dist.get_rank())  # the ranks start from different random states
    sizes = {"mp_size": 2} if legacy else {"tensor_parallel": {"tp_size": 2}}
    engine = zerolap.init_inference(model, dtype=torch.float32, **sizes)
    assert engine.mp_group is not None and engine.module is model
    split = [n for n, p in model.named_parameters() if getattr(p, "tp_split", None) is not None]
    assert len(split) == 2 * (6 if arch == "gpt2" else 7), split  # every block's matrices
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(engine(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)
        greedy = engine.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(greedy, dense.generate(input_ids=ids, max_new_tokens=8, do_sample=False))
        state = torch.get_rng_state()  # the group's shared state, the same on both ranks
        sampled = engine.generate(input_ids=ids, max_new_tokens=8, do_sample=True, top_k=0)
        torch.set_rng_state(state)
        want = dense.generate(input_ids=ids, max_new_tokens=8, do_sample=True, top_k=0)
    assert torch.equal(sampled, want)
    assert torch.equal(greedy, dist.all_gather(greedy)[0])
    assert torch.equal(sampled, dist.all_gather(sampled)[0])


@pytest.mark.parametrize(("arch", "legacy"), [("gpt2", False), ("llama", True)])
def test_split_model_generates_as_the_dense_one(ranks, arch, legacy):
    pytest.importorskip("transformers")
    ranks(2).run(check_split_model_generates_as_dense, arch, legacy)


def check_pipeline_after_init_inference() -> str:
    """DeepSpeed's text-generation example: ``pipe.model = init_inference(pipe.model, ...)``
    inside a transformers pipeline, which reads the model's ``generation_config``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, pipeline

    words = {"<unk>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tokens = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokens.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokens, unk_token="<unk>", eos_token="<unk>", pad_token="<unk>"
    )
    pipe = pipeline("text-generation", model=_hf("gpt2"), tokenizer=tokenizer, device=-1)
    want = pipe("w1 w2 w3", do_sample=False, max_new_tokens=6)
    pipe.model = zerolap.init_inference(
        pipe.model, mp_size=2, dtype=torch.float, replace_with_kernel_inject=False
    )
    got = pipe("w1 w2 w3", do_sample=False, max_new_tokens=6)
    assert got == want, (got, want)
    assert pipe.model.mp_group is not None
    return got[0]["generated_text"]


def check_rank_local_generate_arguments() -> list:
    """A streamer on rank 0 only (None elsewhere) and keywords in another order are not
    different inputs."""
    import zerolap.comm as dist

    class Streamer:
        def put(self, value) -> None:
            pass

        def end(self) -> None:
            pass

    rank = dist.get_rank()
    engine = zerolap.init_inference(_hf("gpt2"), mp_size=2, dtype=torch.float32)
    arguments = {"input_ids": _ids(), "max_new_tokens": 3, "do_sample": False}
    if rank == 1:
        arguments = dict(reversed(list(arguments.items())))
    with torch.no_grad():
        tokens = engine.generate(**arguments, streamer=Streamer() if rank == 0 else None)
    return tokens.tolist()


def test_rank_local_generate_arguments_are_not_a_mismatch(ranks):
    pytest.importorskip("transformers")
    tokens = ranks(2).run(check_rank_local_generate_arguments)
    assert tokens[0] == tokens[1]


def test_transformers_pipeline_runs_the_split_model(ranks):
    pytest.importorskip("transformers")
    texts = ranks(2).run(check_pipeline_after_init_inference)
    assert texts[0] == texts[1] and len(texts[0].split()) > 3


def check_split_errors() -> None:
    import zerolap.comm as dist

    rank = dist.get_rank()
    model = _hf("gpt2")
    with pytest.raises(ValueError, match="tp_size=3 does not divide the world size 2"):
        zerolap.init_inference(model, tensor_parallel={"tp_size": 3})
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # refused untouched
    with pytest.raises(ValueError, match="init_inference: tensor parallelism: no plan for a "):
        zerolap.init_inference(torch.nn.Sequential(torch.nn.Linear(4, 4)), mp_size=2)
    engine = zerolap.init_inference(model, mp_size=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="already split over a tensor group; pass that group"):
        zerolap.init_inference(model, mp_size=2)
    with pytest.raises(ValueError, match=r"tensor group \[0, 1\] got different inputs at the "):
        engine(_ids() + rank)
    # Settings count too, and are compared before the length limit: one rank over it must not
    # leave the other waiting.
    engine = zerolap.init_inference(_hf("gpt2"), mp_size=2, dtype=torch.float32, max_tokens=7)
    with pytest.raises(ValueError, match="different inputs at the first generate"):
        engine.generate(input_ids=_ids(length=6 + 2 * rank), max_new_tokens=2)
    engine = zerolap.init_inference(_hf("gpt2"), mp_size=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="the same generate settings"):
        engine.generate(input_ids=_ids(), max_new_tokens=2 + rank)


def check_model_split_beforehand() -> list:
    """A layout without a plan: split by ``parallelize`` with a plan of one's own, then given
    to init_inference with its group, which shares the random state and checks inputs."""
    import zerolap.comm as dist
    from zerolap.tensor_parallel import parallelize

    model = _hf("llama")
    dense = copy.deepcopy(model)
    group = dist.new_group([0, 1])
    plan = {
        r".*self_attn\.(q|k|v)_proj": "colwise",
        r".*self_attn\.o_proj": "rowwise",
        r".*mlp\.(gate|up)_proj": "colwise",
        r".*mlp\.down_proj": "rowwise",
    }
    parallelize(model, group, plan)
    torch.manual_seed(dist.get_rank())
    engine = zerolap.init_inference(model, tensor_parallel={"tp_group": group}, dtype="fp32")
    assert engine.mp_group is group
    with torch.no_grad():
        torch.testing.assert_close(engine(_ids()).logits, dense(_ids()).logits)
        sampled = engine.generate(input_ids=_ids(), max_new_tokens=6, do_sample=True, top_k=0)
    return sampled.tolist()


def test_a_model_split_beforehand_is_adopted_with_its_group(ranks):
    pytest.importorskip("transformers")
    sampled = ranks(2).run(check_model_split_beforehand)
    assert sampled[0] == sampled[1]  # one random state over the group


def test_split_errors_are_named_on_every_rank(ranks):
    pytest.importorskip("transformers")
    ranks(2).run(check_split_errors)


def test_dtype_placement_and_length_on_one_process():
    pytest.importorskip("transformers")
    engine = zerolap.init_inference(_hf("llama"))  # DeepSpeed's default dtype: float16
    assert {p.dtype for p in engine.module.parameters()} == {torch.float16}
    assert engine.mp_group is None
    assert engine.config is engine.module.config
    assert engine(_ids()).logits.dtype == torch.float16
    engine = zerolap.init_inference(_hf("llama"), config={"dtype": "bfloat", "max_tokens": 4})
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    with pytest.raises(RuntimeError, match="6 tokens exceeds max_out_tokens=4"):
        engine.generate(input_ids=_ids(), max_new_tokens=2)
    engine.profile_model_time()
    engine(_ids(length=3))
    engine.module(_ids(length=3))
    engine.generate(input_ids=_ids(length=3), max_new_tokens=3, min_new_tokens=3)
    times = engine.model_times()  # each generate step is a forward of the model, as in DeepSpeed
    assert len(times) == 5 and all(t > 0 for t in times) and engine.model_times() == []


def test_config_file_and_keyword_arguments_merge(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"dtype": "fp32", "keep_module_on_host": True}))
    engine = zerolap.init_inference(_hf("gpt2"), config=str(path), max_out_tokens=32)
    assert engine._config.max_out_tokens == 32 and engine._config.keep_module_on_host
    with pytest.raises(ConfigError, match=r"dtype is 'fp32' in config and torch\.float16 as a"):
        zerolap.init_inference(_hf("gpt2"), config=str(path), dtype=torch.float16)


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"replace_with_kernel_inject": True}, "replace_with_kernel_inject: got True"),
        ({"kernel_inject": True}, "replace_with_kernel_inject: got True"),
        ({"dtype": torch.int8}, "dtype: int8 weights need DeepSpeed's quantiser"),
        ({"checkpoint": "ckpt.json"}, "checkpoint: got 'ckpt.json'"),
        ({"enable_cuda_graph": True}, "enable_cuda_graph: got True"),
        (
            {"injection_policy": {"Block": ("attn.c_proj",)}, "mp_size": 2},
            "injection_policy: zerolap splits by its own plans",
        ),
        ({"mp_size": 2, "tp": {"tp_size": 4}}, "mp_size, tp.tp_size: two values"),
        ({"tensor_paralel": {"tp_size": 2}}, "did you mean tensor_parallel"),
        ({"dtype": "fp64"}, "dtype: got 'fp64'; valid: fp32"),
    ],
)
def test_what_zerolap_cannot_do_is_named(given, named):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        zerolap.init_inference(model, **given)
    assert model.weight.dtype == torch.float32  # refused before anything changed


def test_kernel_tuning_keys_are_named_in_a_warning(caplog):
    """So is an injection policy with one rank per copy (the T5 examples pass one with
    ``mp_size=1``): nothing is split, so it says nothing."""
    with caplog.at_level("WARNING", logger="zerolap"):
        engine = zerolap.init_inference(
            torch.nn.Linear(2, 2),
            min_tokens=8,
            triangular_masking=False,
            mp_size=1,
            injection_policy={torch.nn.Linear: ("out",)},
            moe=False,
        )
    assert "have no effect: triangular_masking, min_out_tokens\n" in caplog.text
    assert "injection_policy: no effect: nothing is split" in caplog.text
    assert engine.mp_group is None


def test_a_tensor_parallel_config_object_meets_mp_size():
    from zerolap.config.inference import DeepSpeedTPConfig

    with pytest.raises(ConfigError, match=r"mp_size, tensor_parallel\.tp_size: two values"):
        zerolap.init_inference(
            torch.nn.Linear(2, 2), mp_size=2, tensor_parallel=DeepSpeedTPConfig(tp_size=4)
        )
    engine = zerolap.init_inference(
        torch.nn.Linear(2, 2), mp_size=1, tensor_parallel=DeepSpeedTPConfig(tp_size=1)
    )
    assert engine._config.tensor_parallel.tp_size == 1


def test_meta_model_is_refused_by_name():
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="parameter weight is on the meta device"):
        zerolap.init_inference(model)
