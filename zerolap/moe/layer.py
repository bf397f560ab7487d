"""DeepSpeed's mixture-of-experts layer (``deepspeed.moe.layer.MoE``), every expert on every rank.

``MoE(hidden_size, expert, num_experts, k=...)`` holds ``num_experts`` copies of ``expert`` and
a gate (``zerolap.moe.gating``); each token goes to its k chosen experts' buffers (one einsum
with the dispatch mask), the experts run on their buffers, and the outputs come back weighted by
the gate (another einsum). ``forward`` returns ``(output, l_aux, exp_counts)``: the caller adds
``l_aux`` (times a coefficient) to its loss to keep the experts' load even.

The experts' parameters carry DeepSpeed's marks (``allreduce = False``, ``group_name =
"ep_size_1"``), so ``moe.utils`` puts them in optimizer groups of their own. With one
expert-parallel rank their gradients are averaged over the data-parallel group like any other
parameter's, and ZeRO shards them like any other: stages 0-3 train such a model as one process
does. Experts split over ranks (``ep_size`` above 1) are refused by name: they need an
all-to-all per layer, which zerolap does not have.

Parameter names are DeepSpeed's (``deepspeed_moe.gate.wg.weight``,
``deepspeed_moe.experts.deepspeed_experts.<i>.*``), so state dicts line up with a DeepSpeed
model's; checkpoints hold the experts with the other parameters (DeepSpeed writes them to
per-expert files).
"""

from __future__ import annotations

import copy

import torch

from zerolap.moe.gating import (
    TopKGate,
    refuse_expert_parallelism,
    top1gating,
    top2gating,
    topkgating,
)
from zerolap.utils.logging import warning_once
from zerolap.zero import GatheredParameters

# DeepSpeed keeps the layer and its gates in one module (``deepspeed.moe.sharded_moe``), which
# the shim answers with this one: the gates are importable from here too.
__all__ = ["Experts", "MOELayer", "MoE", "TopKGate", "top1gating", "top2gating", "topkgating"]


class Experts(torch.nn.Module):
    """``num_local_experts`` independent copies of ``expert``; ``forward`` runs copy i on slice
    i of dimension 1 of its input ([ranks, experts, capacity, width])."""

    def __init__(
        self, expert: torch.nn.Module, num_local_experts: int = 1, expert_group_name=None
    ) -> None:
        super().__init__()
        # Built under zero.Init, ``expert``'s children hold only their shards by now: copy the
        # whole values (the copies are plain parameters, sharded in turn once registered below).
        with GatheredParameters(list(expert.parameters())):
            copies = [copy.deepcopy(expert) for _ in range(num_local_experts)]
        self.deepspeed_experts = torch.nn.ModuleList(copies)
        self.num_local_experts = num_local_experts
        for copied in self.deepspeed_experts:
            for param in copied.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs = []
        for chunk, expert in zip(
            inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts, strict=True
        ):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)


class MOELayer(torch.nn.Module):
    """Gate, dispatch, experts, combine. ``forward(tokens, used_token=None)`` keeps the gate's
    ``l_aux`` and ``exp_counts`` as attributes."""

    def __init__(
        self,
        gate: TopKGate,
        experts: Experts,
        ep_group_name: str,
        ep_size: int,
        num_local_experts: int,
        use_tutel: bool = False,
    ) -> None:
        super().__init__()
        refuse_expert_parallelism(ep_size)
        if use_tutel:
            warning_once(
                "MoE use_tutel=True: zerolap has no Tutel kernels; tokens are dispatched with "
                "einsum (the same results)"
            )
        self.gate = gate
        self.experts = experts
        self.ep_group_name = ep_group_name
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        hidden = inputs[0]
        tokens = hidden.reshape(-1, hidden.shape[-1])
        used_token = inputs[1] if len(inputs) > 1 else None
        self.l_aux, combine, dispatch, self.exp_counts = self.gate(tokens, used_token)
        # [E, C, width]: each expert's buffer of the tokens routed to it, zeros in empty slots.
        buffers = torch.einsum("sec,sm->ecm", dispatch.type_as(hidden), tokens)
        outputs = self.experts(buffers[None]).reshape(buffers.shape)
        combined = torch.einsum("sec,ecm->sm", combine.type_as(hidden), outputs)
        return combined.reshape(hidden.shape)


class MoE(torch.nn.Module):
    """DeepSpeed's ``MoE`` layer with ``ep_size=1``.

    ``use_residual`` makes it a residual MoE (PR-MoE): ``expert`` itself also runs on every token
    as a dense MLP, and a learned two-way softmax mixes its output with the experts'.
    ``enable_expert_tensor_parallelism`` is refused (zerolap does not split experts over a
    tensor-parallel group)."""

    def __init__(
        self,
        hidden_size: int,
        expert: torch.nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(
                f"MoE num_experts={num_experts} must be a multiple of ep_size={ep_size}"
            )
        if enable_expert_tensor_parallelism:
            raise NotImplementedError(
                "MoE enable_expert_tensor_parallelism=True: zerolap does not split experts over "
                "a tensor-parallel group"
            )
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        gate = TopKGate(
            hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
            noisy_gate_policy, drop_tokens, use_rts,
            top2_2nd_expert_sampling=top2_2nd_expert_sampling,
        )  # fmt: skip
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(
            gate, experts, self.expert_group_name, ep_size, self.num_local_experts, use_tutel
        )
        if use_residual:
            self.mlp = expert
            self.coefficient = torch.nn.Linear(hidden_size, 2)

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        """``(output, l_aux, exp_counts)``; ``output`` has ``hidden_states``' shape."""
        inputs = (hidden_states,) if used_token is None else (hidden_states, used_token)
        output = self.deepspeed_moe(*inputs)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            mix = torch.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * mix[..., 0:1] + dense * mix[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
