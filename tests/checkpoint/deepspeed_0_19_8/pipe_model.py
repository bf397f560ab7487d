"""The pipeline model, data and ds_config of the DeepSpeed 0.19.8 pipeline checkpoints in this
folder (``pipe_*``), shared by ``generate.py`` (real DeepSpeed) and the tests that resume
them on zerolap. The same code builds either library's ``PipelineModule``: ``pipe`` is the
module (``deepspeed.pipe`` or ``zerolap.pipe``).

An embedding tied to the output layer (the head is the embedding under a ``forward_fn``, so
DeepSpeed writes no layer file for it), a function between layers, and a layer with a
persistent buffer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, WIDTH, HIDDEN = 24, 13, 37
MICRO, SEQ, MICRO_BATCHES = 2, 5, 2
STEPS = 3  # taken before the checkpoint
LR = 1e-2

CASES = {  # name: (ZeRO stage, stages, data-parallel size, the client's torch AdamW)
    # Stage 0 with the client's torch AdamW (its state numbered over each stage's
    # parameters); ZeRO-1 with DeepSpeed's own (FusedAdam over flat partitions).
    "pipe_s0_p2": (0, 2, 1, True),
    "pipe_s1_p2_d2": (1, 2, 2, False),
}


class Scaled(torch.nn.Module):
    """A linear layer whose output is scaled by a persistent buffer."""

    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, out)
        self.register_buffer("scale", torch.linspace(0.9, 1.1, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def _head(embedding: torch.nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def build_model(pipe, stages: int):
    """The pipeline: embed | fc1 | gelu | ln | Scaled | fc2 | head (the embedding again)."""
    torch.manual_seed(1234)
    layers = [
        pipe.TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, WIDTH),
        pipe.LayerSpec(torch.nn.Linear, WIDTH, HIDDEN),
        F.gelu,
        pipe.LayerSpec(torch.nn.LayerNorm, HIDDEN),
        pipe.LayerSpec(Scaled, HIDDEN, HIDDEN),
        pipe.LayerSpec(torch.nn.Linear, HIDDEN, WIDTH),
        pipe.TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, WIDTH, forward_fn=_head),
    ]
    return pipe.PipelineModule(
        layers=layers, num_stages=stages, loss_fn=_loss, partition_method="uniform"
    )


def micro_batch(step: int, micro: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``dp_rank``'s micro-batch ``micro`` of (1-based) step ``step``."""
    generator = torch.Generator().manual_seed(10000 * step + 100 * dp_rank + micro)
    x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator)
    return x, torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator)


def batches(step: int, dp_rank: int):
    """An iterator over step ``step``'s micro-batches of ``dp_rank``."""
    return iter([micro_batch(step, m, dp_rank) for m in range(MICRO_BATCHES)])


def client_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01
    )


def ds_config(stage: int, dp: int, client: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "train_batch_size": MICRO * MICRO_BATCHES * dp,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "zero_optimization": {"stage": stage},
        # No clipping (both default to 1.0): with a tie across stages DeepSpeed's pipeline
        # clips by another norm than the whole model's (the README's pipeline section).
        "gradient_clipping": 0.0,
    }
    if client:
        del config["optimizer"]
    return config
