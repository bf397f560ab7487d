"""Ulysses sequence parallelism (``zerolap.sequence_parallel``): the exchanges trade sequence
pieces for heads and back exactly; a Hugging Face Llama whose attention runs through
``UlyssesSPAttentionHF`` computes, piece by piece, the loss and gradients of the whole model
on whole sequences (key/value heads split, and repeated when fewer than the ranks); the data
adapter cuts every rank's batches into pieces with the next token's labels; and what it does
not run is refused by name."""

from __future__ import annotations

import pytest
import torch

import zerolap.comm as dist

TIMEOUT = 180.0
VOCAB = 64


def _global(shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def trade() -> float:
    from zerolap.sequence_parallel.exchange import to_heads, to_sequence

    rank, size = dist.get_rank(), dist.get_world_size()
    b, h, length, d = 2, 2 * size, 3, 5
    whole = _global((b, h, length * size, d), 0)
    mine = whole[:, :, rank * length : (rank + 1) * length].clone().requires_grad_()
    heads = to_heads(mine, None, size)
    worst = (heads - whole[:, rank * 2 : rank * 2 + 2]).abs().max().item()
    # The kernel's layout [b, seq, heads, d], back to this rank's tokens with every head.
    back = to_sequence(heads.transpose(1, 2), None, size)
    expected = (
        whole[:, :, rank * length : (rank + 1) * length].transpose(1, 2).reshape(b, length, -1)
    )
    worst = max(worst, (back - expected).abs().max().item())
    weights = _global(back.shape, 1 + rank)
    (back * weights).sum().backward()
    # d/d mine of sum(back * w) is w itself, in mine's layout.
    expected_grad = weights.reshape(b, length, h, d).transpose(1, 2)
    return max(worst, (mine.grad - expected_grad).abs().max().item())


@pytest.mark.parametrize("world", [2, 4])
def test_the_exchanges_trade_sequence_pieces_for_heads_and_back(ranks, world):
    for worst in ranks(world).run(trade, timeout=TIMEOUT):
        assert worst == 0.0


def _llama(kv_heads: int, heads: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=VOCAB, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def whole_model(kv_heads: int, seq: int, heads: int = 4) -> float:
    """Summed token losses: each rank's piece's sum, whose gradients summed over the ranks are
    the whole model's gradients of the whole sequences' sum."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from zerolap.sequence_parallel import UlyssesSPAttentionHF

    rank, size = dist.get_rank(), dist.get_world_size()
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(seq).expand(2, seq)
    labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]

    def summed(model, ids, positions, labels):
        logits = model(input_ids=ids, position_ids=positions).logits
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB).float(), labels.reshape(-1), reduction="sum"
        )

    dense = _llama(kv_heads, heads)
    expected = summed(dense, ids, positions, labels)
    expected.backward()
    model = _llama(kv_heads, heads)
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        UlyssesSPAttentionHF.register_with_transformers(
            model, "sdpa", size, micro_batch_size=2, seq_length=seq, seq_length_is_variable=False
        )
        piece = slice(rank * seq // size, (rank + 1) * seq // size)
        loss = summed(model, ids[:, piece], positions[:, piece], labels[:, piece])
        loss.backward()
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original
    total = loss.detach().clone()
    dist.all_reduce(total)
    worst = abs(total.item() - expected.item()) / abs(expected.item())
    for p, q in zip(model.parameters(), dense.parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        worst = max(worst, ((grad - q.grad).abs().max() / q.grad.abs().max()).item())
    # Every rank's module counts the model's key/value groups again after the call.
    attention = model.model.layers[0].self_attn
    assert attention.num_key_value_groups == heads // kv_heads
    return worst


@pytest.mark.parametrize(
    ("world", "heads", "kv_heads"), [(2, 4, 2), (2, 4, 4), (2, 8, 4), (4, 4, 2), (4, 4, 1)]
)
def test_a_sequence_parallel_llama_computes_what_the_whole_model_does(
    ranks, world, heads, kv_heads
):
    for worst in ranks(world).run(whole_model, kv_heads, 16, heads, timeout=TIMEOUT):
        assert worst < 1e-5


def adapt(lengths: list[int]) -> list:
    """Each rank's loader yields its own batches (rank r: sequences of ``lengths[r]`` tokens,
    one label entry off by one from the ids, a non-tensor entry); the adapter's pieces."""
    from zerolap.sequence_parallel import UlyssesSPDataLoaderAdapter

    rank, size = dist.get_rank(), dist.get_world_size()
    seq = lengths[rank]

    def batch(k: int) -> dict:
        ids = torch.arange(seq).expand(2, seq) + 1000 * rank + 100 * k
        return {
            "input_ids": ids,
            "labels": ids + 1,
            "position_ids": torch.arange(seq).expand(2, seq),
            "tag": f"{rank}/{k}",
        }

    loader = [batch(0), batch(1)]
    adapter = UlyssesSPDataLoaderAdapter(loader, rank, None, size, torch.device("cpu"))
    assert len(adapter) == 2 * size
    seen = [next(adapter) for _ in range(2 * size)]
    with pytest.raises(StopIteration):
        next(adapter)
    again = next(adapter)  # the next epoch starts over
    assert again["input_ids"].tolist() == seen[0]["input_ids"].tolist()
    return [
        (
            b["input_ids"].tolist(),
            b["shift_labels"].tolist(),
            b["position_ids"].tolist(),
            b["tag"],
            "labels" in b,
        )
        for b in seen
    ]


def test_the_adapter_gives_each_rank_its_piece_of_every_ranks_batches(ranks):
    lengths = [8, 4]  # the ranks' batches may differ in length: each is cut by its own
    answers = ranks(2).run(adapt, lengths, timeout=TIMEOUT)
    for rank, pieces in enumerate(answers):
        order = [(owner, k) for k in range(2) for owner in range(2)]
        for (owner, k), (ids, shifted, positions, tag, has_labels) in zip(
            order, pieces, strict=True
        ):
            seq = lengths[owner]
            whole = torch.arange(seq).expand(2, seq) + 1000 * owner + 100 * k
            half = slice(rank * seq // 2, (rank + 1) * seq // 2)
            assert ids == whole[:, half].tolist()
            # the next token's label; -100 after the last token of the whole sequence
            labels = torch.nn.functional.pad(whole + 1, (0, 1), value=-100)[:, 1:]
            assert shifted == labels[:, half].tolist()
            assert positions == torch.arange(seq).expand(2, seq)[:, half].tolist()
            assert tag == f"{owner}/{k}" and not has_labels


def refusals() -> list[str]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from zerolap.sequence_parallel import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    size = dist.get_world_size()
    said = []
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        for kwargs in (
            {"core_attn_implementation": "eager"},
            {"core_attn_implementation": "flex_attention"},
            {"core_attn_implementation": "sdpa", "seq_length_is_variable": False},
            {"core_attn_implementation": "sdpa", "seq_length": 15, "seq_length_is_variable": False},
        ):
            model = _llama(2)
            model.config._attn_implementation = kwargs["core_attn_implementation"]
            with pytest.raises(ValueError) as error:
                UlyssesSPAttentionHF.register_with_transformers(
                    model, sequence_parallel_size=size, micro_batch_size=2, **kwargs
                )
            said.append(str(error.value))
        model = _llama(2)
        with pytest.raises(ValueError) as error:  # the model runs sdpa
            UlyssesSPAttentionHF.register_with_transformers(model, "flash_attention_2", size, 2)
        said.append(str(error.value))
        with pytest.raises(ValueError) as error:  # 3 heads over 2 ranks
            UlyssesSPAttentionHF(original, 2, 3, 8, 3, 2, None, seq_length_is_variable=True)
        said.append(str(error.value))
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", size, 2)
        ids = torch.randint(0, VOCAB, (2, 8))
        with pytest.raises(ValueError) as error:  # another batch size than micro_batch_size
            model(input_ids=ids[:1, :4], position_ids=torch.arange(4)[None])
        said.append(str(error.value))
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original
    for batch in (
        {"input_ids": ids, "labels": ids},
        {"input_ids": ids[:, :7], "labels": ids[:, :7], "position_ids": ids[:, :7]},
        {"input_ids": ids, "labels": ids[:, :4], "position_ids": ids},
    ):
        adapter = UlyssesSPDataLoaderAdapter([batch], dist.get_rank(), None, size, "cpu")
        with pytest.raises(ValueError) as error:
            next(adapter)
        said.append(str(error.value))
    return said


def test_what_sequence_parallelism_does_not_run_is_refused_by_name(ranks):
    said = ranks(2).run(refusals, timeout=TIMEOUT)[0]
    assert "'eager'" in said[0] and "mask" in said[0]
    assert "'flex_attention'" in said[1]
    assert "seq_length" in said[2]
    assert "seq_length 15 is not divisible by sequence_parallel_size 2" in said[3]
    assert "'flash_attention_2'" in said[4] and "'sdpa'" in said[4]
    assert "3 attention heads are not divisible by the sequence-parallel size 2" in said[5]
    assert "query of shape (1, 4, 4, 8)" in said[6] and "batch 2" in said[6]
    assert "needs 'position_ids'" in said[7]
    assert "sequences of 7 tokens, not divisible by the 2 ranks" in said[8]
    assert "'labels' has shape (2, 4)" in said[9]


def _sp_loss(model, batch: dict, group) -> torch.Tensor:
    """The Trainer's loss under sequence parallelism (``deepspeed_sp_compute_loss``), for its
    gradient: the pieces' mean losses weighted by their tokens, all-gathered, whose backward
    gives each piece S times its weight. (torch's differentiable all_gather, which the Trainer
    uses, scatters with group ranks taken as global ones on gloo, so its backward fails in a
    group that does not start at rank 0; the Trainer test runs it with S = world.)"""
    loss = model(**batch, labels=batch["shift_labels"]).loss  # as the Trainer passes them
    tokens = (batch["shift_labels"] != -100).sum().float()
    total = tokens.clone()
    dist.all_reduce(total, group=group)
    return loss * tokens * dist.get_world_size(group) / total


def _batch(d: int, step: int, seq: int) -> dict:
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(100 * step + d))
    return {"input_ids": ids, "labels": ids, "position_ids": torch.arange(seq).expand(2, seq)}


def train_sequence_parallel(stage: int, steps: int = 3, seq: int = 16) -> dict:
    """S=2 x D=2 on 4 ranks: each data-parallel pair's batch cut over its two ranks."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import zerolap
    from zerolap.comm.logger import COMMS_LOGGER
    from zerolap.runtime import groups
    from zerolap.sequence_parallel import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "eps": 1e-6, "weight_decay": 0.01}},
        "comms_logger": {"enabled": True},
    }
    model = _llama(2)
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 2)
        engine, *_ = zerolap.initialize(model=model, config=config, mpu=mpu)
        d, s = engine.get_data_parallel_rank(), groups._get_sequence_parallel_rank()
        seen = {
            "groups": (
                groups._get_sequence_parallel_world_size(), s,
                groups._get_data_parallel_world_size(), d,
                groups._get_sequence_data_parallel_world_size(),
                groups._get_sequence_data_parallel_rank(),
            ),
            "engine": (
                engine.dp_world_size, engine.seq_dp_world_size,
                engine.sequence_parallel_size, engine.world_size,
            ),
        }  # fmt: skip
        group = groups._get_sequence_parallel_group()
        # Every rank draws its own batches; each pair runs its two ranks' batches in turn.
        mine = [_batch(dist.get_rank(), step, seq) for step in range(steps)]
        loader = UlyssesSPDataLoaderAdapter(mine, s, group, 2, "cpu")
        COMMS_LOGGER.records.clear()
        for _ in range(2 * steps):
            engine.backward(_sp_loss(engine, next(loader), group))
            engine.step()
        exchanged = [r for r in COMMS_LOGGER.records if r.op == "all_to_all_single"]
        seen["exchanged"] = [r.message_bytes for r in exchanged[:8]]
        params = [zerolap.utils.safe_get_full_fp32_param(p).clone() for p in model.parameters()]
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original
    # One process: the whole model on whole sequences. Micro-batch (step, owner) is, on pair
    # d, the batch of rank 2 d + owner; its gradient is the mean over the two pairs.
    dense = _llama(2)
    optimizer = torch.optim.AdamW(dense.parameters(), lr=0.01, eps=1e-6, weight_decay=0.01)
    for step in range(steps):
        for owner in range(2):
            optimizer.zero_grad()
            losses = [dense(**_batch(2 * pair + owner, step, seq)).loss for pair in range(2)]
            (sum(losses) / 2).backward()
            torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5)
            optimizer.step()
    seen["worst"] = max(
        ((p - q).abs().max() / q.abs().max()).item()
        for p, q in zip(params, dense.parameters(), strict=True)
    )
    return seen


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sequence_parallel_2_by_data_parallel_2_trains_as_one_process(ranks, stage):
    """4 ranks, S=2 x D=2 through ``initialize(mpu=...)`` with the mpu that
    ``register_with_transformers`` returns: ZeRO shards over all four, gradients are averaged
    to the loss's own (the Trainer's all-gathered loss), and AdamW with clipping after 6 steps
    gives the parameters of one process on whole sequences. Each layer's forward exchanges
    query, key, value and output once: this rank's [2, heads, 8, 8] fp32 pieces."""
    for rank, seen in enumerate(ranks(4).run(train_sequence_parallel, stage, timeout=TIMEOUT)):
        d, s = divmod(rank, 2)
        assert seen["groups"] == (2, s, 2, d, 4, rank)
        assert seen["engine"] == (2, 4, 2, 4)
        assert seen["exchanged"] == [2048, 1024, 1024, 2048] * 2
        assert seen["worst"] < 1e-5


def test_the_mesh_lays_sequence_ranks_out_consecutively():
    from zerolap.topology import ParallelDims

    dims = ParallelDims(8, sequence=4)
    assert dims.data == 2
    assert dims.sequence_ranks(1) == [4, 5, 6, 7]
    assert dims.data_ranks(0, 0, sequence_rank=3) == [3, 7]
    assert [dims.coordinates(r)[1] for r in range(8)] == [0] * 4 + [1] * 4
    assert [dims.sequence_rank(r) for r in range(8)] == [0, 1, 2, 3] * 2
    with pytest.raises(
        ValueError, match="sequence_parallel_size=3 does not divide the world size 8"
    ):
        ParallelDims(8, sequence=3)
    with pytest.raises(ValueError, match="runs with data parallelism only"):
        ParallelDims(8, tensor=2, sequence=2)


def with_experts_or_foreign_mpu() -> list[str]:
    import zerolap
    from zerolap.moe.layer import MoE
    from zerolap.sequence_parallel import state

    said = []
    state.initialize_sequence_parallel(2)
    model = torch.nn.Sequential(MoE(8, torch.nn.Linear(8, 8), 2, ep_size=2))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    with pytest.raises(NotImplementedError) as error:
        zerolap.initialize(model=model, config=config, mpu=state)
    said.append(str(error.value))

    class MegatronMpu:  # Megatron-DeepSpeed's: sequence-parallel groups, of one rank unless set
        def __init__(self, size: int) -> None:
            self.size = size

        def get_sequence_parallel_world_size(self) -> int:
            return self.size

        def get_data_parallel_group(self):
            return dist.get_world_group()

        def get_model_parallel_world_size(self) -> int:
            return 1

        def get_model_parallel_group(self):
            return None

    with pytest.raises(TypeError) as error:
        zerolap.initialize(model=torch.nn.Linear(2, 2), config=config, mpu=MegatronMpu(2))
    said.append(str(error.value))
    engine, *_ = zerolap.initialize(model=torch.nn.Linear(2, 2), config=config, mpu=MegatronMpu(1))
    said.append(f"{engine.dp_world_size} {engine.sequence_parallel_size}")
    return said


def test_experts_spread_over_ranks_and_foreign_sequence_groups_are_refused(ranks):
    said = ranks(2).run(with_experts_or_foreign_mpu, timeout=TIMEOUT)[0]
    assert "ep_size=2 with tensor, pipeline or sequence parallelism" in said[0]
    assert "groups of 2 ranks must be zerolap's" in said[1]
    assert said[2] == "2 1"  # without sequence parallelism it is a Megatron mpu as before


def checkpoint_across(stage: int, root: str) -> float:
    """Trained 2 steps with S=2 over both ranks and saved; loaded into a plain data-parallel
    engine (and one with S=2 again): both continue as the uninterrupted run does."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import zerolap
    from zerolap.sequence_parallel import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    rank = dist.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "eps": 1e-6}},
    }
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def engine_with(sp: bool):
        model = _llama(2)
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 2) if sp else None
        engine, *_ = zerolap.initialize(model=model, config=config, mpu=mpu)
        return engine

    def params(engine):
        return [
            zerolap.utils.safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()
        ]

    try:
        engine = engine_with(sp=True)
        group = engine.get_sequence_parallel_group()
        batches = UlyssesSPDataLoaderAdapter([_batch(rank, 0, 16)], rank, group, 2, "cpu")
        for batch in batches:
            engine.backward(_sp_loss(engine, batch, group))
            engine.step()
        engine.save_checkpoint(root, tag="sp")
        after = _batch(0, 9, 16)  # one more whole sequence, the same on both ranks
        pieces = UlyssesSPDataLoaderAdapter([after], rank, group, 2, "cpu")
        engine.backward(_sp_loss(engine, next(pieces), group))
        engine.step()
        expected = params(engine)
        resumed = engine_with(sp=True)
        resumed.load_checkpoint(root, tag="sp")
        pieces = UlyssesSPDataLoaderAdapter([after], rank, group, 2, "cpu")
        resumed.backward(_sp_loss(resumed, next(pieces), group))
        resumed.step()
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original
    worst = max((a - b).abs().max().item() for a, b in zip(params(resumed), expected, strict=True))
    plain = engine_with(sp=False)  # the plain sdpa kernel again: whole sequences on each rank
    plain.load_checkpoint(root, tag="sp")
    plain.backward(plain(**after).loss)
    plain.step()
    return max(
        worst, *((a - b).abs().max().item() for a, b in zip(params(plain), expected, strict=True))
    )


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_sequence_parallel_checkpoint_resumes_with_and_without_it(ranks, stage, tmp_path):
    for worst in ranks(2).run(checkpoint_across, stage, str(tmp_path), timeout=TIMEOUT):
        assert worst < 1e-5


def one_rank_draws_a_bad_batch() -> str:
    from zerolap.sequence_parallel import UlyssesSPDataLoaderAdapter

    rank = dist.get_rank()
    ids = torch.zeros(2, 8, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids, "position_ids": ids}
    if rank == 1:
        del batch["position_ids"]
    adapter = UlyssesSPDataLoaderAdapter([batch], rank, None, 2, "cpu")
    with pytest.raises(ValueError) as error:
        next(adapter)
    with pytest.raises(ValueError) as wrong:
        UlyssesSPDataLoaderAdapter([batch], 1 - rank, None, 2, "cpu")
    return f"{error.value} | {wrong.value}"


def test_a_batch_one_rank_cannot_use_is_the_same_named_error_on_every_rank(ranks):
    """Not a hang in a gather the other ranks never join."""
    for rank, said in enumerate(ranks(2).run(one_rank_draws_a_bad_batch, timeout=TIMEOUT)):
        assert "rank 1 of the group: every batch needs 'position_ids'" in said
        assert f"sp_rank {1 - rank} of sp_world_size 2, but this rank is rank {rank}" in said


def evaluate_and_reregister() -> dict:
    """Eval mode with ``disable_in_eval`` runs the plain kernel, the padding mask kept;
    registering again wraps the kernel, not the wrapper; a wrapper whose groups were
    replaced refuses to run; the reduction dtype under sequence parallelism."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import zerolap
    from zerolap.sequence_parallel import UlyssesSPAttentionHF, state

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    seen = {}
    try:
        plain, model = _llama(2), _llama(2)
        ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[0, :3] = 0  # left padding
        expected = plain.eval()(input_ids=ids, attention_mask=mask).logits
        register = UlyssesSPAttentionHF.register_with_transformers
        register(model, "sdpa", 2, 2, disable_in_eval=True)
        register(model, "sdpa", 2, 2, disable_in_eval=True)
        seen["wraps the kernel"] = ALL_ATTENTION_FUNCTIONS["sdpa"].zerolap_core is original
        got = model.eval()(input_ids=ids, attention_mask=mask).logits
        seen["eval"] = (got - expected).abs().max().item()
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        }
        engine, *_ = zerolap.initialize(model=model.train(), config=config, mpu=state)
        seen["reduced in"] = (engine.grads.comm_dtype, engine.communication_data_type())
        config["seq_parallel_communication_data_type"] = "bf16"
        engine, *_ = zerolap.initialize(model=_llama(2), config=config, mpu=state)
        seen["reduced in, bf16 asked"] = engine.grads.comm_dtype
        if dist.get_world_size() == 4:
            state.initialize_sequence_parallel(4)  # the wrapper's groups are replaced
            with pytest.raises(RuntimeError) as error:
                model(input_ids=ids[:, :2], position_ids=torch.arange(2).expand(2, 2))
            seen["stale"] = str(error.value)
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original
    return seen


@pytest.mark.parametrize("world", [2, 4])
def test_evaluation_registration_and_the_reduction_dtype(ranks, world):
    for seen in ranks(world).run(evaluate_and_reregister, timeout=TIMEOUT):
        assert seen["wraps the kernel"]
        assert seen["eval"] < 1e-6
        # DeepSpeed's rule: seq_parallel_communication_data_type (fp32 by default) under S > 1
        assert seen["reduced in"] == (torch.float32, torch.float32)
        assert seen["reduced in, bf16 asked"] == torch.bfloat16
        if world == 4:
            assert "groups that were replaced" in seen["stale"]


def group_questions() -> dict:
    """DeepSpeed's module-level group questions in a fresh job: before any engine, and after
    one holding experts spread over both ranks."""
    import deepspeed.utils.groups as groups  # through the shim, as clients ask

    import zerolap
    from zerolap.moe.layer import MoE

    seen = {
        "before": (
            groups._get_data_parallel_world_size(),
            groups._get_sequence_parallel_world_size(),
        )
    }
    with pytest.raises(KeyError) as error:
        groups._get_sequence_parallel_group()
    seen["no sequence group"] = str(error.value)
    model = torch.nn.Sequential(MoE(8, torch.nn.Linear(8, 8), 2, ep_size=2))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    zerolap.initialize(model=model, config=config)
    seen["experts"] = (
        dist.get_all_ranks_from_group(groups._get_expert_parallel_group("ep_size_2")),
        groups._get_expert_parallel_world_size("ep_size_2"),
        groups._get_expert_parallel_rank("ep_size_2"),
        groups._get_expert_data_parallel_world_size("ep_size_2"),
        sorted(groups._get_expert_parallel_group_dict()),
        groups._get_data_parallel_world_size(),
    )
    with pytest.raises(KeyError) as error:
        groups._get_expert_parallel_group("ep_size_4")
    seen["no such experts"] = str(error.value)
    return seen


def test_deepspeeds_group_questions_are_answered_from_the_jobs_mesh():
    from tests.multiproc import run_on_ranks

    for rank, seen in enumerate(run_on_ranks(group_questions, 2, timeout=TIMEOUT)):
        assert seen["before"] == (2, 1)
        assert "No sequence parallel group found" in seen["no sequence group"]
        assert seen["experts"] == ([0, 1], 2, rank, 1, ["ep_size_2"], 2)
        assert "'ep_size_4'" in seen["no such experts"] and "ep_size_2" in seen["no such experts"]
