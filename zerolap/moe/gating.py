"""Which expert each token goes to, and with what weight: DeepSpeed's top-k gates (GShard).

Each function takes the gate's logits for S tokens over E experts (fp32) and returns
``(l_aux, combine_weights, dispatch_mask, exp_counts)``:

* ``combine_weights`` [S, E, C]: token s's weight for the slot c it takes in expert e's buffer
  of C = capacity slots (zero where it takes none), so the layer dispatches with one einsum
  and combines with another;
* ``dispatch_mask``: where ``combine_weights`` is non-zero;
* ``l_aux``: the load-balancing loss, E x sum over experts of (mean gate probability x share of
  tokens routed there), so 1 when the load is even (scaled as DeepSpeed scales it per k);
* ``exp_counts`` [E]: tokens each expert was chosen by, before any was dropped.

A token an expert has no room for is dropped from that expert (its weight there is zero; with
k = 1 the layer's output for it is zero, a residual connection outside the layer carries it).
With ``drop_tokens=False`` the capacity grows to the busiest expert's count, so none is.

Under expert parallelism (``ep_group``) every rank's buffers must be the same size for the
all-to-all, so the capacity is the largest over the group: the busiest expert's anywhere, or
with ``drop_tokens`` the capacity of the rank with the most tokens. DeepSpeed agrees only the
first; its buffers differ, and its all-to-all fails, when ranks route different numbers of
tokens (a shorter last batch, sequences padded per batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import zerolap.comm as dist
from zerolap.utils.logging import warning_once

__all__ = [
    "NOISY_GATE_POLICIES",
    "TopKGate",
    "capacity",
    "no_tutel",
    "top1gating",
    "top2gating",
    "topkgating",
]

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
"""``noisy_gate_policy`` values: none; the gate's input scaled by uniform noise in
[1 - 1e-2, 1 + 1e-2] while training (``Jitter``); Gumbel noise on the logits that pick top-1's
expert (``RSample``)."""

JITTER = 1e-2


def capacity(tokens: int, experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert: an even share of the tokens times ``capacity_factor``, at least
    ``min_capacity``. The product is rounded up in fp32, as DeepSpeed computes it: in float64
    400 / 8 x 1.1 would round up to 56 where DeepSpeed gives 55, and drop other tokens."""
    share = torch.tensor(float(capacity_factor), dtype=torch.float32) * (tokens / experts)
    return max(int(torch.ceil(share)), min_capacity)


def _gumbel(shape, device) -> torch.Tensor:
    uniform = torch.rand(shape, device=device).clamp(min=torch.finfo(torch.float32).tiny)
    return -torch.log(-torch.log(uniform))


def _combine(weights: torch.Tensor, slots: torch.Tensor, kept: torch.Tensor, room: int):
    """[S, E, C] combine weights (each kept (token, expert) pair's weight at its slot) and the
    dispatch mask."""
    one_hot = F.one_hot(torch.where(kept, slots, 0), room).to(weights.dtype)
    combine = (weights * kept)[..., None] * one_hot
    return combine, combine.bool()


def _positions(mask: torch.Tensor, offset: torch.Tensor | int = 0) -> torch.Tensor:
    """Each chosen (token, expert)'s place in the expert's queue, tokens in order."""
    return torch.cumsum(mask, dim=0) - 1 + offset


def _balance_loss(gates: torch.Tensor, first_choice: torch.Tensor) -> torch.Tensor:
    experts = gates.shape[1]
    return torch.sum(gates.mean(dim=0) * first_choice.float().mean(dim=0)) * experts


def no_tutel(use_tutel: bool) -> None:
    """DeepSpeed's Tutel kernels are a faster path to the same routing; zerolap dispatches with
    einsum, and says so once when they are asked for."""
    if use_tutel:
        warning_once(
            "MoE use_tutel=True: zerolap has no Tutel kernels; tokens are dispatched with "
            "einsum (the same results)"
        )


def _agreed(room: int, ep_group, device) -> int:
    """``room``, the largest over the expert-parallel group (itself without one): one small
    all-reduce, and a wait for it, per gate call, since the room sizes the buffers."""
    if ep_group is None:
        return room
    largest = torch.tensor(room, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=ep_group)
    return int(largest)


def _room_for_all(exp_counts: torch.Tensor, tokens: int, ep_group) -> int:
    """Room for every token: the busiest expert's count, over the expert-parallel group."""
    room = max(min(int(exp_counts.max()), tokens), 1)
    return _agreed(room, ep_group, exp_counts.device)


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group=None,
    use_tutel: bool = False,
):
    """Each token to its most probable expert (with ``RSample``, the most probable after Gumbel
    noise), weighted by that probability. Over capacity, ``use_rts`` keeps a random choice of
    the expert's tokens (random token selection); otherwise the first ones in order.
    ``used_token`` [S] (0 or 1) routes only the tokens it marks. ``use_tutel``: see
    ``no_tutel``."""
    no_tutel(use_tutel)
    gates = F.softmax(logits, dim=1)
    tokens, experts = gates.shape
    chooser = (
        logits + _gumbel(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    )
    mask = F.one_hot(chooser.argmax(dim=1), experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    if drop_tokens:
        room = capacity(tokens, experts, capacity_factor, min_capacity)
        room = _agreed(room, ep_group, gates.device)
    else:
        room = _room_for_all(exp_counts, tokens, ep_group)
    l_aux = _balance_loss(gates, mask)
    if use_rts:
        priority = mask * torch.rand(mask.shape, device=mask.device)
        chosen = priority.topk(min(room, tokens), dim=0).indices
        mask = mask * torch.zeros_like(mask).scatter_(0, chosen, 1)
    else:
        mask = mask * (_positions(mask) < room)
    combine, dispatch = _combine(gates, _positions(mask), mask.bool(), room)
    return l_aux, combine, dispatch, exp_counts


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=None,
    top2_2nd_expert_sampling: bool = True,
):
    """Each token to its most probable expert and a second one (the next most probable, or with
    ``top2_2nd_expert_sampling`` the most probable after Gumbel noise), weights renormalised
    over the two it keeps. Every first choice queues before every second; each expert has
    2 x ``capacity_factor`` of an even share of slots."""
    gates = F.softmax(logits, dim=1)
    tokens, experts = gates.shape
    first = F.one_hot(gates.argmax(dim=1), experts)
    if top2_2nd_expert_sampling:
        logits = logits + _gumbel(logits.shape, logits.device)
    second = F.one_hot(logits.masked_fill(first.bool(), float("-inf")).argmax(dim=1), experts)
    slots_first = _positions(first)
    slots_second = _positions(second, first.sum(dim=0, keepdim=True))
    exp_counts = (first + second).sum(dim=0).detach()
    l_aux = _balance_loss(gates, first)
    if drop_tokens:
        room = capacity(tokens, experts, 2 * capacity_factor, min_capacity)
        room = _agreed(room, ep_group, gates.device)
    else:
        room = _room_for_all(exp_counts, tokens, ep_group)
    first = first * (slots_first < room)
    second = second * (slots_second < room)
    kept = first + second
    share = (gates * kept).sum(dim=1, keepdim=True)
    weights = gates / share.clamp(min=torch.finfo(gates.dtype).eps)
    slots = slots_first * first + slots_second * second
    combine, dispatch = _combine(weights, slots, kept.bool(), room)
    return l_aux, combine, dispatch, exp_counts


def topkgating(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=None,
    drop_policy: str = "probs",
):
    """Each token to its k most probable experts, weights renormalised over those it keeps.
    Over an expert's k x ``capacity_factor`` share of slots, ``drop_policy`` ``probs`` keeps the
    tokens that chose it most strongly, ``position`` the first ones."""
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"drop_policy={drop_policy!r}: use 'probs' or 'position'")
    gates = F.softmax(logits, dim=1)
    tokens, experts = gates.shape
    top = gates.topk(k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.long).scatter_(1, top.indices, 1)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = _balance_loss(gates, mask) / k
    if not drop_tokens:
        room = _room_for_all(exp_counts, tokens, ep_group)
    else:
        room = capacity(tokens, experts, k * capacity_factor, min_capacity)
        room = _agreed(room, ep_group, gates.device)
        if drop_policy == "probs":
            strongest = (gates * mask).topk(min(room, tokens), dim=0).indices
            mask = mask * torch.zeros_like(mask).scatter_(0, strongest, 1)
        else:
            mask = mask * (_positions(mask) < room)
    share = (gates * mask).sum(dim=1, keepdim=True)
    weights = gates / share.clamp(min=torch.finfo(gates.dtype).eps)
    combine, dispatch = _combine(weights, _positions(mask), mask.bool(), room)
    return l_aux, combine, dispatch, exp_counts


class _GateLinear(torch.nn.Linear):
    """The gate's bias-free map to one logit per expert, computed in fp32 whatever the model's
    dtype. A module of its own, called rather than read, so that ZeRO stage 3 gathers its
    weight around the call."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(tokens.float(), self.weight.float())


class TopKGate(torch.nn.Module):
    """The gate: a bias-free linear map from the model's width to one logit per expert, in
    fp32, and the top-k routing above. ``capacity_factor`` while training,
    ``eval_capacity_factor`` in eval mode; ``noisy_gate_policy`` only while training (top-2's
    sampled second expert, ``top2_2nd_expert_sampling``, in eval mode too, as in DeepSpeed).
    ``ep_group``: the expert-parallel group, which the engine sets (``MOELayer._set_ep_group``)."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group=None,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(
                f"noisy_gate_policy={noisy_gate_policy!r}: use one of {NOISY_GATE_POLICIES}"
            )
        if not 1 <= k <= num_experts:
            raise ValueError(f"k={k}: a token picks between 1 and num_experts={num_experts}")
        if noisy_gate_policy == "RSample" and k != 1:
            raise ValueError("noisy_gate_policy='RSample' applies to top-1 gating only (k=1)")
        self.wg = _GateLinear(model_dim, num_experts, bias=False)
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.ep_group = ep_group

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group

    def forward(
        self, tokens: torch.Tensor, used_token: torch.Tensor | None = None, use_tutel=False
    ):
        """``tokens`` [S, model_dim] -> ``(l_aux, combine_weights, dispatch_mask, exp_counts)``
        (``use_tutel``: see ``no_tutel``)."""
        no_tutel(use_tutel)
        tokens = tokens.float()
        noise = self.noisy_gate_policy if self.training else None
        if noise == "Jitter":
            tokens = tokens * torch.empty_like(tokens).uniform_(1 - JITTER, 1 + JITTER)
        logits = self.wg(tokens)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if used_token is not None and self.k != 1:
            raise ValueError("used_token applies to top-1 gating only (k=1)")
        if self.k == 1:
            return top1gating(
                logits, factor, self.min_capacity, used_token, noise, self.drop_tokens,
                self.use_rts, self.ep_group,
            )  # fmt: skip
        if self.k == 2:
            return top2gating(
                logits, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                self.top2_2nd_expert_sampling,
            )  # fmt: skip
        return topkgating(
            logits, self.k, factor, self.min_capacity, self.drop_tokens, self.ep_group
        )
