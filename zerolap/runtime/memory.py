"""Model-state memory per rank: bytes of the tensors the engine holds, against the formulas.

``zero_formula_bytes`` is the ZeRO paper's accounting as DeepSpeed realises it
(``profiling.estimate.bytes_per_param``: p + g + m + k bytes per parameter at stage 0, the
optimizer's m + k sharded at stage 1, g as well at stage 2), with no fp32 master at stage 0 in
fp32.

For fp32 AdamW that is 16, 8 + 12/N and 4 + 16/N bytes. zerolap keeps no fp32 master of fp32
weights (the optimizer steps on the flat parameter buffer itself), so ``expected_bytes`` is the
same formula with m = 0 in fp32: 16, 8 + 8/N, 4 + 12/N. With bf16 masters
(``bf16.bf16_master_weights_and_grads``) likewise m = 0, with bf16 gradients and state.

Under expert parallelism the experts a rank holds are sharded over the ranks holding the same
experts (N / ep_size of them), so their share of the formula takes that N.

Offload to disk (``device: nvme``) moves part of that out of memory: ``swapped_bytes`` is what
the swap files hold (optimizer state and master values, stage-3 parameter shards), and the
buffers it streams through are ``swap_buffer_bytes``. ``total_bytes`` counts what stays
resident, so ``total_bytes + swapped_bytes`` is the formula's figure (up to the files' 4 KiB
alignment), and the formula is unchanged by offload.

On an accelerator, ``offload_optimizer`` moves the offloaded runs' fp32 master values and
optimizer state to host memory, where their gradients are copied too, and ``offload_param``
moves stage 3's parameter shard there: ``host_bytes``, not in ``total_bytes`` (what the device
holds).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from zerolap.moe.parallel import expert_parallel_size
from zerolap.offload.states import OffloadStateTypeEnum
from zerolap.profiling.estimate import Precision, bytes_per_param
from zerolap.zero.status import full_numel

__all__ = ["MemoryBreakdown", "measure_memory"]


@dataclass(frozen=True)
class MemoryBreakdown:
    rank: int
    stage: int
    world_size: int
    numel: int  # trainable parameters, without padding
    params_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_state_bytes: int
    bucket_buffer_bytes: int  # reusable gradient bucket buffers, not model state
    param_buffer_bytes: int  # stage 3: pooled memory of released units, for the next gathers
    swap_buffer_bytes: int  # offload to nvme: the buffers swapped state streams through
    swapped_bytes: int  # offload to nvme: model state held in swap files, not in memory
    host_bytes: int  # offload from an accelerator: master, state, gradient copies on the host
    expected_bytes: float  # zerolap's formula for this stage and precision (see module doc)
    zero_formula_bytes: float  # the ZeRO / DeepSpeed formula, with its master copy

    @property
    def total_bytes(self) -> int:
        """Resident model state: parameters, gradients, master weights and optimizer state
        held in memory (swapped state not included)."""
        return self.params_bytes + self.grads_bytes + self.master_bytes + self.optimizer_state_bytes

    def as_dict(self) -> dict:
        return asdict(self) | {"total_bytes": self.total_bytes}


def measure_memory(engine) -> MemoryBreakdown:
    """The engine's model-state bytes on this rank. An engine without an optimizer holds no
    gradients or optimizer state; below stage 3 it holds no flat buffer either (its parameters
    are the model's own, counted here as whole)."""
    store, grads, optimizer = engine.param_store, engine.grads, engine.optimizer
    numel = sum(full_numel(p) for p in engine.params)
    experts = sum(full_numel(p) for p in engine.params if expert_parallel_size(p) > 1)
    dtype = store.dtype if store is not None else next(engine.module.parameters()).dtype
    param_bytes = torch.empty((), dtype=dtype).element_size()
    mixed = param_bytes < 4
    # bf16 masters (bf16.bf16_master_weights_and_grads): the parameters are their own master,
    # gradients and AdamW's state in their dtype.
    own16 = optimizer is not None and optimizer.low_precision_master
    grad_bytes = 4 if engine.plan.shard_gradients and not own16 else param_bytes
    state_bytes = 2 * param_bytes if own16 else 8
    stage, n = engine.plan.stage, engine.world_size

    def formula(master: int) -> float:
        precision = Precision(param=param_bytes, grad=grad_bytes, master=master, state=state_bytes)
        spread = bytes_per_param(stage, n // engine.ep_size, precision) if experts else 0
        return (numel - experts) * bytes_per_param(stage, n, precision) + experts * spread

    # DeepSpeed keeps a master copy except in fp32 at stage 0; for bf16 masters a bf16 one at
    # stages 1-2, none at stage 3 (it steps the partitioned parameters themselves).
    bf16_copy = param_bytes if stage < 3 else 0
    zero_master = bf16_copy if own16 else 4 if (mixed or stage > 0) else 0

    # offload_states: what it parked is in host memory, not where training runs.
    parked = optimizer.parked.parked_bytes() if optimizer is not None else {}
    kind = OffloadStateTypeEnum

    def held(nbytes: int, *kinds: OffloadStateTypeEnum) -> int:
        return max(0, nbytes - sum(parked.get(k, 0) for k in kinds))

    return MemoryBreakdown(
        rank=engine.global_rank,
        stage=stage,
        world_size=n,
        numel=numel,
        params_bytes=held(store.nbytes(), kind.lp_params) if store is not None else 0,
        grads_bytes=held(grads.nbytes(), kind.lp_grads) if grads is not None else 0,
        master_bytes=held(optimizer.master_bytes(), kind.hp_params) if optimizer else 0,
        optimizer_state_bytes=held(optimizer.state_bytes(), kind.optim_states) if optimizer else 0,
        bucket_buffer_bytes=grads.buffer_bytes() if grads is not None else 0,
        param_buffer_bytes=store.buffer_bytes() if store is not None else 0,
        swap_buffer_bytes=(optimizer.buffer_bytes() if optimizer is not None else 0)
        + (store.swap_buffer_bytes() if store is not None else 0),
        swapped_bytes=(optimizer.swapped_bytes() if optimizer is not None else 0)
        + (store.swapped_bytes() if store is not None else 0),
        host_bytes=sum(parked.values())
        + (optimizer.host_bytes() if optimizer is not None else 0)
        + (store.host_bytes() if store is not None else 0)
        + (grads.host_bytes() if grads is not None else 0),
        expected_bytes=formula(master=4 if mixed and not own16 else 0),
        zero_formula_bytes=formula(master=zero_master),
    )
