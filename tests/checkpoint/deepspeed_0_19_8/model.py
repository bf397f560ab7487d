"""The model, data and ds_config of the DeepSpeed 0.19.8 checkpoints in this folder, shared by
``generate.py`` (which wrote them with real DeepSpeed) and the tests that resume them on zerolap.

Odd sizes on purpose (ZeRO pads them), an embedding tied to the output layer, a frozen
parameter, a persistent and a non-persistent buffer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, WIDTH, HIDDEN = 24, 13, 37
MICRO, SEQ = 4, 5
STEPS = 3  # taken before the checkpoint
LR, MIN_LR, WEIGHT_DECAY = 1e-2, 1e-3, 0.01

CASES = {  # name: (ZeRO stage, world size, bf16, two param groups)
    "s0_ws2": (0, 2, False, False),
    "s0_ws2_bf16": (0, 2, True, False),
    "s1_ws2": (1, 2, False, False),
    "s2_ws2": (2, 2, False, False),
    "s2_ws2_bf16": (2, 2, True, False),
    "s3_ws2": (3, 2, False, False),
    "s3_ws2_2g": (3, 2, False, True),
}
UNIVERSAL = ("s2_ws2", "s2_ws2_bf16", "s3_ws2_2g")  # also converted by ds_to_universal


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.fc1 = torch.nn.Linear(WIDTH, HIDDEN)
        self.ln = torch.nn.LayerNorm(HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, WIDTH, bias=False)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.frozen_bias = torch.nn.Parameter(torch.linspace(-0.1, 0.1, WIDTH), requires_grad=False)
        self.register_buffer("scale", torch.linspace(0.9, 1.1, WIDTH))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.ln(F.gelu(self.fc1(self.embed(x))))
        h = (self.fc2(h) + self.frozen_bias) * self.scale.to(h.dtype)
        return F.cross_entropy(self.head(h).float().view(-1, VOCAB), y.view(-1))


def build_model() -> TinyNet:
    torch.manual_seed(1234)
    return TinyNet()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch of (1-based) step ``step``."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator)
    return x, torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator)


def param_groups(model: TinyNet, two_groups: bool):
    """What the scripts pass as ``model_parameters``."""
    if not two_groups:
        return model.parameters()  # frozen one included: DeepSpeed skips it
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]


def ds_config(stage: int, world: int, bf16: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "train_batch_size": MICRO * world,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": WEIGHT_DECAY},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": MIN_LR,
                "warmup_max_lr": LR,
                "warmup_num_steps": 5,
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    return config
