"""A small tied-embedding language model as a pipeline layer list, and its plain-torch
reference trained by gradient accumulation over the same micro-batches. Residual MLP blocks,
no attention: every gradient is well away from rounding noise, so 1e-6 parity is meaningful
after AdamW (attention's key bias has a zero gradient in exact arithmetic, which Adam turns
from rounding noise into full-size steps)."""

from __future__ import annotations

import torch
from torch import nn

from zerolap.pipe import LayerSpec, PipelineModule, TiedLayerSpec

VOCAB, WIDTH, SEQ, BLOCKS, MICRO = 32, 16, 6, 6, 2
LR, CLIP = 0.01, 0.05


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, WIDTH) * 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(tokens, self.weight)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def head(embed: Embed, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(x, embed.weight)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def layers(blocks: int = BLOCKS) -> list:
    return [
        TiedLayerSpec("embed", Embed),
        *(LayerSpec(Block) for _ in range(blocks)),
        LayerSpec(nn.LayerNorm, WIDTH),
        TiedLayerSpec("embed", Embed, forward_fn=head),
    ]


def pipeline(stages: int, **kwargs) -> PipelineModule:
    """The model on ``stages`` stages; layer ``i`` seeded with 1234 + i wherever it is built."""
    kwargs.setdefault("partition_method", "uniform")
    return PipelineModule(layers(), num_stages=stages, loss_fn=loss_fn, seed_layers=True, **kwargs)


def batch(step: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(VOCAB, (samples, SEQ + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def micro_batches(step: int, gas: int, data: int, data_rank: int) -> list:
    """Data-parallel rank ``data_rank``'s micro-batches of step ``step``: micro-batch ``m``
    of the global batch is sample block ``m * data + data_rank``."""
    tokens, targets = batch(step, MICRO * gas * data)
    out = []
    for m in range(gas):
        lo = (m * data + data_rank) * MICRO
        out.append((tokens[lo : lo + MICRO], targets[lo : lo + MICRO]))
    return out


def reference(
    steps: int, gas: int | list[int], data: int, clip: float = CLIP, autocast: bool = False
):
    """One process, one copy of the model, gradient accumulation over all ``gas * data``
    micro-batches (``gas``: one count, or one per step): per step the mean loss, the gradient
    norm, and the final parameters. ``autocast``: the model's forward (not the loss) under
    bf16 autocast."""
    counts = gas if isinstance(gas, list) else [gas] * steps
    torch.set_num_threads(1)
    model = pipeline(1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        step_losses = []
        for data_rank in range(data):
            for tokens, targets in micro_batches(step, counts[step], data, data_rank):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    out = model(tokens)
                loss = loss_fn(out, targets)
                (loss / (counts[step] * data)).backward()
                step_losses.append(loss.detach())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or 1e30).item())
        opt.step()
        losses.append(torch.stack(step_losses).mean().item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}
