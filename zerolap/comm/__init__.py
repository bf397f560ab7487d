"""``zerolap.comm``: the collective API of ``deepspeed.comm`` on top of ``torch.distributed``.

Use it as ``import zerolap.comm as dist``. Every op checks its arguments before any communication,
accepts ``async_op=True`` (returning a ``Handle`` whose ``wait()`` finishes it) and passes through
the comms logger, whose records also feed the overlap profiler.
"""

from zerolap.comm.collectives import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    broadcast,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    send,
)
from zerolap.comm.groups import (
    barrier,
    destroy_process_group,
    get_backend,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    new_group,
)
from zerolap.comm.handle import CommError, Handle
from zerolap.comm.logger import COMMS_LOGGER, configure, log_summary, reset_log
from zerolap.comm.reduce_ops import ReduceOp
from zerolap.comm.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter

__all__ = [
    "COMMS_LOGGER",
    "CommError",
    "Handle",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "configure",
    "destroy_process_group",
    "get_backend",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "irecv",
    "is_initialized",
    "isend",
    "log_summary",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reset_log",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "send",
]
