"""How many bytes a collective puts on the wire, and how bandwidth is normalised.

Pure arithmetic shared by the comms logger, the tests and the benchmarks.

Message size conventions (as in nccl-tests): an all-gather's message is its *output* (all ranks'
pieces), a reduce-scatter's its *input*; every other op's message is the tensor passed.

``ring_wire_bytes`` is what one rank sends when the op runs as a ring over ``n`` ranks:
all-reduce 2S(n-1)/n, all-gather and reduce-scatter S(n-1)/n; broadcast and reduce run as a chain
around the ring, so every rank sends S except the chain's tail (the rank before the root for a
broadcast, the root itself for a reduce). ``bus_factor`` turns algorithm bandwidth (S / time) into
bus bandwidth, comparable across ops and world sizes.
"""

from __future__ import annotations

__all__ = ["bus_factor", "ring_wire_bytes"]

_RING_SHARE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


def base_op(op: str) -> str:
    """Strip variant suffixes: ``all_gather_into_tensor`` -> ``all_gather``, ``ring_all_reduce``
    -> ``all_reduce``, ``isend`` -> ``send``."""
    op = op.removeprefix("ring_")
    for base in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier"):
        if op.startswith(base):
            return base
    return {"isend": "send", "irecv": "recv"}.get(op, op)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' factor from algorithm to bus bandwidth for ``op`` on ``n`` ranks."""
    share = _RING_SHARE.get(base_op(op))
    return share(n) if share is not None and n > 0 else 1.0


def ring_wire_bytes(
    op: str, message_bytes: int, n: int, *, group_rank: int = 0, root: int | None = None
) -> int:
    """Bytes this rank sends for ``op`` on a message of ``message_bytes`` over a ring of ``n``."""
    if n <= 1:
        return 0
    op = base_op(op)
    share = _RING_SHARE.get(op)
    if share is not None:
        return round(message_bytes * share(n))
    if op == "broadcast":
        return 0 if group_rank == ((root or 0) - 1) % n else message_bytes
    if op == "reduce":
        return 0 if group_rank == (root or 0) else message_bytes
    if op == "send":
        return message_bytes
    return 0
