"""``zerolap.comm``: the collective API of ``deepspeed.comm`` on top of ``torch.distributed``.

Use it as ``import zerolap.comm as dist``. Every op checks its arguments before any communication,
accepts ``async_op=True`` where DeepSpeed does (returning a ``Handle`` whose ``wait()`` finishes
it) and passes through the comms logger, whose records also feed the overlap profiler.
"""

from zerolap.comm.backend import TorchBackend
from zerolap.comm.barriers import barrier, check_in, monitored_barrier
from zerolap.comm.checks import buffer_device
from zerolap.comm.coalesced import (
    all_gather_coalesced,
    all_reduce_coalesced,
    allgather_fn,
    has_all_gather_into_tensor,
    has_all_reduce_coalesced,
    has_reduce_scatter_tensor,
    inference_all_reduce,
    reduce_scatter_fn,
)
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
    through_group_device,
)
from zerolap.comm.debug import CollectiveMismatch
from zerolap.comm.exchange import all_to_all, all_to_all_single, gather, scatter
from zerolap.comm.groups import (
    destroy_process_group,
    get_all_ranks_from_group,
    get_backend,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_group,
    get_world_size,
    init_distributed,
    is_available,
    is_initialized,
    new_group,
)
from zerolap.comm.handle import CommError, Handle
from zerolap.comm.logger import (
    COMMS_LOGGER,
    configure,
    get_comm_operation_count,
    get_logged_comm_ops,
    has_comm_data,
    log_summary,
    reset_log,
)
from zerolap.comm.objects import all_gather_object, broadcast_object_list, gather_object
from zerolap.comm.reduce_ops import ReduceOp
from zerolap.comm.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from zerolap.comm.watchdog import CheckInError

__all__ = [
    "COMMS_LOGGER",
    "CheckInError",
    "CollectiveMismatch",
    "CommError",
    "Handle",
    "ReduceOp",
    "TorchBackend",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "buffer_device",
    "check_in",
    "configure",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_all_ranks_from_group",
    "get_backend",
    "get_comm_operation_count",
    "get_global_rank",
    "get_local_rank",
    "get_logged_comm_ops",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_comm_data",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "reset_log",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "scatter",
    "send",
    "through_group_device",
]
