"""How many bytes a collective puts on the wire, and how bandwidth is normalised.

Pure arithmetic shared by the comms logger, the tests and the benchmarks.

Message size conventions (as in nccl-tests): an all-gather's message is its *output* (all ranks'
pieces), a reduce-scatter's its *input*, a gather's the gathered pieces, a scatter's the pieces
scattered, an all-to-all's what this rank sends (its input); every other op's message is the
tensor passed.

``ring_wire_bytes`` is what one rank sends when the op runs as a ring over ``n`` ranks:
all-reduce 2S(n-1)/n, all-gather and reduce-scatter S(n-1)/n; broadcast and reduce run as a chain
around the ring, so every rank sends S except the chain's tail (the rank before the root for a
broadcast, the root itself for a reduce). Gather, scatter and all-to-all go straight to their
peers: a gather's non-root ranks send their piece S/n, a scatter's root all pieces but its own
S(n-1)/n, and an evenly split all-to-all S(n-1)/n on every rank. ``bus_factor`` turns algorithm
bandwidth (S / time) into bus bandwidth, comparable across ops and world sizes.
"""

from __future__ import annotations

__all__ = ["bus_factor", "ring_wire_bytes"]

_RING_SHARE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
# nccl-tests' bus factors: the ring shares, and (n-1)/n for gather and scatter.
_BUS_SHARE = {
    **_RING_SHARE,
    "gather": _RING_SHARE["all_gather"],
    "scatter": _RING_SHARE["all_gather"],
}
# Checked in order: "all_gather" before "gather", so "all_gather_object" is an all-gather.
_BASE_OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "gather",
    "scatter",
    "barrier",
)


def base_op(op: str) -> str:
    """Strip variant suffixes: ``all_gather_into_tensor`` -> ``all_gather``, ``ring_all_reduce``
    -> ``all_reduce``, ``all_to_all_single`` -> ``all_to_all``, ``isend`` -> ``send``."""
    op = op.removeprefix("ring_")
    for base in _BASE_OPS:
        if op.startswith(base):
            return base
    return {"isend": "send", "irecv": "recv"}.get(op, op)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' factor from algorithm to bus bandwidth for ``op`` on ``n`` ranks."""
    share = _BUS_SHARE.get(base_op(op))
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
    if op == "gather":
        return 0 if group_rank == (root or 0) else message_bytes // n
    if op == "scatter":
        return message_bytes * (n - 1) // n if group_rank == (root or 0) else 0
    if op == "send":
        return message_bytes
    return 0
