"""The model, data and ds_config of the DeepSpeed 0.19.8 mixture-of-experts checkpoints in this
folder (``generate.py`` wrote them; the tests resume them on zerolap).

Two MoE layers of 4 experts spread over 2 expert-parallel ranks, a dense head, and the
optimizer from the ds_config, which both libraries split into a dense group and an expert group
(``configure_moe_param_groups``). The layer class is the running library's (``deepspeed.moe``
or ``zerolap.moe``), passed in."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, WIDTH, EXPERTS, EP = 16, 8, 4, 2
MICRO, SEQ = 2, 6
STEPS = 2  # taken before the checkpoint
LR = 0.02

CASES = {  # name: (ZeRO stage, world size)
    "moe_s0_ep2": (0, 2),
    "moe_s2_w4_ep2": (2, 4),
}


class MoENet(torch.nn.Module):
    def __init__(self, moe_class, ep_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)

        def expert():
            return torch.nn.Sequential(
                torch.nn.Linear(WIDTH, 2 * WIDTH),
                torch.nn.ReLU(),
                torch.nn.Linear(2 * WIDTH, WIDTH),
            )

        # No token dropped and no randomness: both libraries route alike.
        common = {"capacity_factor": 8.0, "min_capacity": 4, "use_rts": False}
        self.moe1 = moe_class(WIDTH, expert(), EXPERTS, ep_size, k=1, **common)
        self.moe2 = moe_class(
            WIDTH, expert(), EXPERTS, ep_size, k=2, top2_2nd_expert_sampling=False, **common
        )
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        out, aux1, _ = self.moe1(h)
        h = h + out
        out, aux2, _ = self.moe2(h)
        h = h + out
        return F.cross_entropy(self.head(h).view(-1, VOCAB), y.view(-1)) + 0.01 * (aux1 + aux2)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch of (1-based) step ``step``."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator)
    return x, torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator)


def ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,  # DeepSpeed's stage 0 clips by another norm under MoE
    }


def global_names(model: torch.nn.Module, ep_rank: int) -> dict[str, str]:
    """Local parameter name -> the name with the expert's global index (local copy i of
    expert-parallel rank e is expert e x (EXPERTS / EP) + i)."""
    out = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        if "deepspeed_experts" in parts:
            at = parts.index("deepspeed_experts") + 1
            parts[at] = str(ep_rank * (EXPERTS // EP) + int(parts[at]))
        out[name] = ".".join(parts)
    return out
