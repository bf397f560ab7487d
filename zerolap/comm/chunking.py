"""Splitting ``numel`` elements into ``n`` contiguous chunks, the unit of every ring step."""

from __future__ import annotations

__all__ = ["even_chunks"]


def even_chunks(numel: int, n: int) -> list[tuple[int, int]]:
    """``n`` half-open ``(start, end)`` ranges covering ``range(numel)`` in order.

    Sizes differ by at most one element (the first ``numel % n`` chunks get the extra one), so a
    length that is not a multiple of ``n`` needs no padding and no extra bytes on the wire.
    """
    if n <= 0:
        raise ValueError(f"cannot split into {n} chunks")
    if numel < 0:
        raise ValueError(f"cannot split a negative numel {numel}")
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
