"""A small GPT-style decoder for the demo and the benchmarks, and deterministic synthetic batches.

Token and position embeddings, ``n_layer`` pre-LN blocks (causal self-attention through
``scaled_dot_product_attention``, then a GELU MLP), a final LayerNorm and an LM head tied to the
token embedding. ``build_gpt("small")`` (~5M parameters) is quick; ``build_gpt("42m")`` (~42M)
matches the model the peers were measured on in FACTS.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "PRESETS",
    "GPTConfig",
    "build_gpt",
    "pipeline_layers",
    "pipeline_loss",
    "pipeline_names",
    "synthetic_batch",
]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    """Tokens in the vocabulary (also the LM head's output width)."""
    seq_len: int
    """Context length: tokens per sample."""
    n_layer: int
    """Transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``d_model``."""
    d_model: int
    """Width of the residual stream."""


PRESETS: dict[str, GPTConfig] = {
    "small": GPTConfig(vocab_size=4096, seq_len=128, n_layer=5, n_head=4, d_model=256),
    "42m": GPTConfig(vocab_size=8192, seq_len=256, n_layer=12, n_head=8, d_model=512),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"n_head={cfg.n_head} does not divide d_model={cfg.d_model}")
        # Heads on this rank: tensor parallelism divides n_head and keeps head_dim.
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        heads = self.qkv(x).view(batch, seq, 3, self.n_head, self.head_dim)
        q, k, v = heads.permute(2, 0, 3, 1, 4)  # each (batch, head, seq, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, self.n_head * self.head_dim))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one tensor, counted once
        # A module, so that tensor parallelism can swap in the vocab-parallel loss.
        self.criterion = nn.CrossEntropyLoss()
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits, (batch, seq, vocab), for ``tokens`` (batch, seq)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``targets`` given ``tokens`` (both (batch, seq))."""
        logits = self.logits(tokens)
        return self.criterion(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_gpt(size: str, *, seed: int = 0) -> GPT:
    """The preset ``size`` ("small" or "42m"), initialised from ``seed``: same seed, same
    weights in every process."""
    if size not in PRESETS:
        raise ValueError(f"unknown GPT size {size!r}; presets: {', '.join(PRESETS)}")
    torch.manual_seed(seed)
    return GPT(PRESETS[size])


def synthetic_batch(
    cfg: GPTConfig, batch_size: int, *, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens (inputs, next-token targets), a pure function of ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class TokenEmbedding(nn.Module):
    """A GPT's token embedding as a pipeline layer, sharing the GPT's weight tensor: the first
    stage embeds with it, the last reads logits from it (``pipeline_layers``)."""

    def __init__(self, source: nn.Embedding) -> None:
        super().__init__()
        self.weight = source.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class AddPositions(nn.Module):
    """Adds the learnt position embedding (the GPT's own module) to token embeddings."""

    def __init__(self, pos_emb: nn.Embedding) -> None:
        super().__init__()
        self.pos_emb = pos_emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pos_emb(torch.arange(x.shape[1], device=x.device))


def _logits_from(embedding: TokenEmbedding, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, embedding.weight)


def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss on a pipeline's last stage."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def pipeline_layers(gpt: GPT, tied_spec: type | None = None) -> list:
    """``gpt`` as a ``zerolap.pipe.PipelineModule`` layer list with the same weights: the token
    embedding tied to the LM head across the first and last stages, then positions, blocks
    and the final norm. Its parameters' names map to the GPT's by ``pipeline_names``.
    ``tied_spec``: another ``TiedLayerSpec`` class of the same shape (DeepSpeed's, to compare)."""
    from zerolap.pipe import TiedLayerSpec

    TiedLayerSpec = tied_spec or TiedLayerSpec
    return [
        TiedLayerSpec("embed", TokenEmbedding, gpt.tok_emb),
        AddPositions(gpt.pos_emb),
        *gpt.blocks,
        gpt.ln_f,
        TiedLayerSpec("embed", TokenEmbedding, gpt.tok_emb, forward_fn=_logits_from),
    ]


def pipeline_names(gpt: GPT, stage_module: nn.Module) -> dict[str, str]:
    """A pipeline stage's parameter names (built by ``pipeline_layers(gpt)``) -> the GPT's."""
    dense = {id(p): n for n, p in gpt.named_parameters()}
    return {n: dense[id(p)] for n, p in stage_module.named_parameters() if id(p) in dense}
