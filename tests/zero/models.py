"""Small deterministic models and data shared by the engine tests."""

from __future__ import annotations

import torch


class TiedMLP(torch.nn.Module):
    """An embedding tied to the output layer, a parameter unused on odd steps, and a buffer."""

    def __init__(self, vocab: int = 13, width: int = 24) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.hidden = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.sometimes = torch.nn.Linear(width, width)
        self.out = torch.nn.Linear(width, vocab, bias=False)
        self.out.weight = self.embed.weight  # tied
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, tokens: torch.Tensor, use_sometimes: bool = True) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.embed(tokens)))
        if use_sometimes:
            h = h + self.sometimes(h)
        return self.out(self.norm(h))


def make_model(seed: int = 0) -> TiedMLP:
    torch.manual_seed(seed)
    return TiedMLP()


def global_batch(step: int, size: int, vocab: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (size, 6), generator=g)
    return tokens, torch.roll(tokens, 1, dims=1)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )


def rank_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``micro`` samples of step ``step``'s global batch (every rank's together)."""
    import zerolap.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(step, micro * world)
    mine = slice(rank * micro, (rank + 1) * micro)
    return tokens[mine], targets[mine]


def assert_equal_on_every_rank(a: list, b: list) -> None:
    """Two runs' per-rank lists of tensors are bitwise equal, rank by rank."""
    for mine, theirs in zip(a, b, strict=True):
        for x, y in zip(mine, theirs, strict=True):
            assert torch.equal(x, y)
