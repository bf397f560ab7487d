"""Ulysses sequence parallelism for Hugging Face models (DeepSpeed's ALST path:
``deepspeed.runtime.sequence_parallel.ulysses_sp``, which Accelerate and the Trainer call
when ``ParallelismConfig(sp_backend="deepspeed", sp_size=S)``).

S ranks share each sequence, each holding L = seq / S consecutive tokens and the whole model.
Everything outside attention works on the rank's own tokens; attention needs the whole
sequence, so before it an all-to-all trades the pieces for heads (each rank then holds the
whole sequence for H / S heads), the model's own attention kernel runs, and the reverse
all-to-all trades back. The gradients of the S ranks' copies are summed over them as over
data-parallel ranks (``zerolap.topology``: ZeRO works over all D x S ranks).

* ``state``: the groups (DeepSpeed's ``parallel_state_sp``, the ``mpu`` the engine is given);
* ``exchange``: how it talks (the all-to-alls, the gathers of position ids and batches);
* ``attention``: what it does (``UlyssesSPAttentionHF``: the attention wrapper and its
  registration with transformers);
* ``data``: ``UlyssesSPDataLoaderAdapter``, which cuts each batch into the ranks' pieces.

DeepSpeed's other ALST pieces (``TiledMLP``, ``SequenceTiledCompute``,
``TiledFusedLogitsLoss``: memory savings by tiling, which neither Accelerate nor the Trainer
call) are not provided.
"""

from zerolap.sequence_parallel.attention import UlyssesSPAttentionHF
from zerolap.sequence_parallel.data import UlyssesSPDataLoaderAdapter

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]
