"""DeepSpeed's mixture-of-experts layer (``deepspeed.moe.layer.MoE``), its experts spread over
``ep_size`` ranks.

``MoE(hidden_size, expert, num_experts, ep_size=..., k=...)`` holds ``num_experts / ep_size``
copies of ``expert`` on each rank and a gate (``zerolap.moe.gating``) over all ``num_experts``;
each token goes to its k chosen experts' buffers (one einsum with the dispatch mask), the
buffers travel to the ranks holding their experts (``zerolap.comm.differentiable``: one all-to-all
over the expert-parallel group), the experts run on every rank's tokens at once, the outputs
travel back (the reverse all-to-all) and come back weighted by the gate (another einsum).
``forward`` returns ``(output, l_aux, exp_counts)``: the caller adds ``l_aux`` (times a
coefficient) to its loss to keep the experts' load even.

Expert-parallel rank e (its place in its group, ``zerolap.topology``) holds experts
``e * L ... e * L + L - 1`` of the ``num_experts`` (L local ones), as in DeepSpeed. The groups
are the engine's to make: ``initialize`` gives each layer its group, and a layer split over
ranks refuses to run before that.

The experts' parameters carry DeepSpeed's marks (``allreduce = False``, ``group_name =
"ep_size_<E>"``), so ``moe.utils`` puts them in optimizer groups of their own, and the engine
reduces and shards them over the ranks holding the same experts (the expert-data-parallel
group). Parameter names are DeepSpeed's (``deepspeed_moe.gate.wg.weight``,
``deepspeed_moe.experts.deepspeed_experts.<i>.*``, i the local index); checkpoints name the
experts by their global index (``moe.parallel``), so a run resumes at another ``ep_size`` and
consolidates to the state dict of the model with every expert on one rank.
"""

from __future__ import annotations

import copy

import torch

import zerolap.comm as dist
from zerolap.comm.differentiable import all_to_all
from zerolap.moe.gating import TopKGate, no_tutel, top1gating, top2gating, topkgating
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
        self.first_expert = 0  # the global index of local expert 0 (set with the groups)
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
    """Gate, dispatch, exchange, experts, exchange back, combine. ``forward(tokens,
    used_token=None)`` keeps the gate's ``l_aux`` and ``exp_counts`` as attributes."""

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
        no_tutel(use_tutel)
        self.gate = gate
        self.experts = experts
        self.ep_group_name = ep_group_name
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.ep_group = None  # the expert-parallel group (``_set_ep_group``, by the engine)
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def _set_ep_group(self, ep_group) -> None:
        """The expert-parallel group (DeepSpeed's name for the call); this rank's place in it
        says which experts it holds."""
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)
        self.experts.first_expert = dist.get_rank(ep_group) * self.num_local_experts

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """``forward(tokens, used_token=None)``."""
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(
                f"MoE layer with ep_size={self.ep_size} run before zerolap.initialize: its "
                "experts are spread over an expert-parallel group, which the engine makes; run "
                "the model through the engine initialize returns"
            )
        hidden = inputs[0]
        width = hidden.shape[-1]
        tokens = hidden.reshape(-1, width)
        used_token = inputs[1] if len(inputs) > 1 else None
        self.l_aux, combine, dispatch, self.exp_counts = self.gate(tokens, used_token)
        # [E, C, width]: each expert's buffer of the tokens routed to it, zeros in empty slots.
        buffers = torch.einsum("sec,sm->ecm", dispatch.type_as(hidden), tokens)
        if self.ep_size > 1:
            # Block j (experts j*L ... j*L+L-1) to expert-parallel rank j; back come every
            # rank's buffers for this rank's experts, [ranks * L, C, width] in rank order.
            buffers = all_to_all(buffers, self.ep_group)
        local = buffers.reshape(self.ep_size, self.num_local_experts, -1, width)
        outputs = self.experts(local).reshape(buffers.shape)
        if self.ep_size > 1:
            outputs = all_to_all(outputs, self.ep_group)  # each block back where it came from
        combined = torch.einsum("sec,ecm->sm", combine.type_as(hidden), outputs)
        return combined.reshape(hidden.shape)


class MoE(torch.nn.Module):
    """DeepSpeed's ``MoE`` layer: ``num_experts`` experts, ``num_experts / ep_size`` of them on
    each rank of an expert-parallel group of ``ep_size``.

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
