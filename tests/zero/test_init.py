"""``zerolap.zero.Init``: a model built inside it is sharded module by module and never whole on
any rank; its values (rank 0's, ``self.apply(init_fn)`` included) survive ``initialize``;
``Init(module=...)`` shards an existing model; ``Init(enabled=False)`` does nothing."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import sys
import threading
import time

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.multiproc import run_on_ranks
from zerolap.zero import GatheredParameters, Init, ParamStatus

TIMEOUT = 60.0


def stage3_config(*, bf16: bool = False, threshold: int = 0) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold},
    }


# -- peak memory while building ----------------------------------------------------------------


class Tower(torch.nn.Module):
    """Square layers appended one by one, as a transformer's blocks are."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            self.layers.append(torch.nn.Linear(width, width, bias=False))


def _anon_bytes() -> int:
    """Anonymous resident memory (tensors and heap; not the shared libraries' pages, which a
    first call into part of libtorch maps in and which are no model state)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _return_freed_memory_at_once() -> None:
    """Make every allocation above 1 MiB its own mapping, unmapped when freed: the resident set
    then follows the bytes alive. (glibc otherwise raises its mmap threshold after the first
    large free and keeps later freed tensors in its heap, so a loop that builds and frees one
    16 MiB tensor at a time grows the resident set by the sum of them.)"""
    m_mmap_threshold = -3
    if ctypes.CDLL(ctypes.util.find_library("c")).mallopt(m_mmap_threshold, 1 << 20) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def _peak_growth(build) -> tuple[int, object]:
    """Growth of the anonymous resident set while ``build()`` runs, at its peak: sampled every
    half millisecond by a thread (a 16 MiB layer lives for milliseconds: being initialised,
    broadcast, cut into its shard), from the set before it."""
    before = _anon_bytes()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _anon_bytes())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = build()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], _anon_bytes()) - before, result


def _build(layers: int, width: int, *, enabled: bool) -> Tower:
    with Init(enabled=enabled):
        return Tower(layers, width)


def build_under_init(layers: int, width: int) -> dict:
    _return_freed_memory_at_once()
    torch.manual_seed(dist.get_rank())
    growth, model = _peak_growth(lambda: _build(layers, width, enabled=True))
    kept = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    whole = sum(p.data.numel() for p in model.parameters())
    del model
    # The control, after (the peak only grows): the same build without Init is seen whole.
    plain_growth, _ = _peak_growth(lambda: _build(layers, width, enabled=False))
    return {"growth": growth, "kept": kept, "whole": whole, "plain_growth": plain_growth}


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc and tunes glibc's malloc")
def test_model_built_under_init_never_materialises_in_full():
    world, layers, width = 4, 16, 2048
    layer_bytes = width * width * 4  # 16 MiB
    full = layers * layer_bytes  # 256 MiB
    for result in run_on_ranks(build_under_init, world, layers, width, timeout=TIMEOUT):
        mib = {k: round(v / 2**20) for k, v in result.items()}
        assert result["whole"] == 0
        assert result["kept"] == full // world, mib
        # The control proves the measure sees a whole model being built (less a little: the
        # baseline's own free heap pages can absorb part of it).
        assert result["plain_growth"] >= 0.85 * full, mib
        # Under Init: this rank's shards plus a layer or two in flight (the one being built and
        # the broadcast's buffers), far below the whole model.
        assert result["growth"] <= full / world + 3 * layer_bytes, mib
        assert result["growth"] <= 0.5 * full, mib


# -- values -------------------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 2 * width)
        self.proj = torch.nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.proj(torch.nn.functional.gelu(self.fc(self.norm(h))))


class TinyGPT(torch.nn.Module):
    """nanoGPT's construction: blocks appended in ``__init__``, a position table owned by the
    root, the head tied to the embedding, then ``self.apply(self._init_weights)``."""

    def __init__(self, vocab: int = 17, width: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, width)
        self.wpe = torch.nn.Parameter(torch.empty(8, width))
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(Block(width))
        self.ln_f = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.apply(self._init_weights)
        torch.nn.init.normal_(self.wpe, std=0.02)

    @staticmethod
    def _init_weights(module: torch.nn.Module) -> None:
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            torch.nn.init.uniform_(module.bias, -0.1, 0.1)  # random: rank 0's must win

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens) + self.wpe[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def reference_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def tokens() -> torch.Tensor:
    return torch.randint(0, 17, (2, 6), generator=torch.Generator().manual_seed(3))


def check_values_after_init_and_initialize(threshold: int, bf16: bool, config_path: str) -> dict:
    cfg = stage3_config(bf16=bf16, threshold=threshold)
    if config_path:
        config_path += f".rank{dist.get_rank()}"  # one file each: a rank truncating the file
        with open(config_path, "w") as f:  # another is reading made the read empty
            json.dump(cfg, f)
    torch.manual_seed(dist.get_rank())  # every rank draws different values; rank 0's are kept
    apply = torch.nn.Module.apply
    with Init(config_dict_or_path=config_path or cfg):
        wrapped = torch.nn.Module.apply is not apply
        model = TinyGPT()
    restored = torch.nn.Module.apply is apply
    dtype = torch.bfloat16 if bf16 else torch.float32
    sharded = all(
        p.ds_status == ParamStatus.SHARDED
        and p.data.numel() == 0
        and p.ds_tensor.dtype == dtype
        and p.ds_tensor.numel() == -(-p.ds_numel // dist.get_world_size())
        for p in model.parameters()
    )
    shapes = [tuple(p.ds_shape) for p in model.parameters()]
    tied = model.head.weight is model.wte.weight
    engine, *_ = zerolap.initialize(model=model, config=cfg)
    reference = reference_gpt().to(dtype)
    values = [
        torch.equal(a, b)
        for a, b in zip(_gathered(engine.module.parameters()), reference.parameters(), strict=True)
    ]
    with torch.no_grad():
        out = engine(tokens())
    return {
        "apply": (wrapped, restored),
        "sharded": sharded,
        "shapes": shapes,
        "tied": tied,
        "values": values,
        "out": torch.equal(out, reference(tokens())),
        # zero.Init's per-parameter shards are gone: each ds_tensor now views the engine's shard
        "own_shard": [_views(p.ds_tensor, engine.param_store.shard) for p in model.parameters()],
    }


def _views(tensor: torch.Tensor, base: torch.Tensor) -> bool:
    start, end = base.data_ptr(), base.data_ptr() + base.numel() * base.element_size()
    return tensor.numel() == 0 or start <= tensor.data_ptr() < end


def _gathered(params) -> list[torch.Tensor]:
    params = list(params)
    with GatheredParameters(params):
        return [p.detach().clone() for p in params]


@pytest.mark.parametrize(
    ("threshold", "bf16", "from_file"),
    [(0, False, False), (100, False, False), (0, True, True)],
    ids=["all sharded", "small modules whole", "bf16 config file"],
)
def test_values_after_init_equal_one_process_with_the_same_seed(
    ranks, tmp_path, threshold, bf16, from_file
):
    path = str(tmp_path / "ds_config.json") if from_file else ""
    results = ranks(2).run(
        check_values_after_init_and_initialize, threshold, bf16, path, timeout=TIMEOUT
    )
    want_shapes = [tuple(p.shape) for p in reference_gpt().parameters()]
    for result in results:
        assert result["apply"] == (True, True)
        assert result["sharded"], "a parameter was not sharded as its module was built"
        assert result["shapes"] == want_shapes
        assert result["tied"]
        assert result["values"] == [True] * len(want_shapes)
        assert result["out"]
        assert result["own_shard"] == [True] * len(want_shapes)


def check_init_of_an_existing_model() -> dict:
    torch.manual_seed(dist.get_rank())
    model = TinyGPT()
    model.ln_f.requires_grad_(False)  # frozen: the engine shards it too, in a unit of its own
    Init(module=model)
    sharded = [
        p.ds_status == ParamStatus.SHARDED and p.data.numel() == 0 for p in model.parameters()
    ]
    engine, *_ = zerolap.initialize(model=model, config=stage3_config())
    frozen_managed = all(p.ds_owner is engine.param_store for p in model.ln_f.parameters())
    reference = reference_gpt()
    values = [
        torch.equal(a, b)
        for a, b in zip(_gathered(model.parameters()), reference.parameters(), strict=True)
    ]
    return {"sharded": sharded, "frozen_managed": frozen_managed, "values": values}


def test_init_with_module_shards_an_existing_model(ranks):
    n = len(list(reference_gpt().parameters()))
    for result in ranks(2).run(check_init_of_an_existing_model, timeout=TIMEOUT):
        assert result["sharded"] == [True] * n
        assert result["frozen_managed"]
        assert result["values"] == [True] * n


def test_init_disabled_is_a_no_op():
    apply = torch.nn.Module.apply
    initialized = dist.is_initialized()
    torch.manual_seed(0)
    with Init(enabled=False, config_dict_or_path=stage3_config()) as context:
        assert torch.nn.Module.apply is apply
        model = TinyGPT()
    existing = reference_gpt()
    Init(module=existing, enabled=False)
    assert context.enabled is False
    assert torch.nn.Module.apply is apply
    for built in (model, existing):
        for got, want in zip(built.parameters(), reference_gpt().parameters(), strict=True):
            assert not hasattr(got, "ds_status") and not hasattr(got, "ds_tensor")
            assert torch.equal(got, want)
    assert dist.is_initialized() == initialized  # no process group set up either


def check_apply_restored_after_an_error() -> bool:
    apply = torch.nn.Module.apply
    with pytest.raises(ValueError, match="boom"), Init():
        torch.nn.Linear(4, 4)
        raise ValueError("boom")
    return torch.nn.Module.apply is apply


def test_init_restores_module_apply_after_an_error(ranks):
    assert ranks(2).run(check_apply_restored_after_an_error, timeout=TIMEOUT) == [True, True]
