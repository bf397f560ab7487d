"""Interval arithmetic behind the overlap figures. Pure functions on ``(start, end)`` pairs."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["covered", "intersection_length", "subtract", "union"]

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points; empty intervals vanish."""
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered(intervals: Iterable[Interval]) -> float:
    """Total length of the union."""
    return sum(end - start for start, end in union(intervals))


def intersection_length(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Length of the points covered by both ``a`` and ``b``."""
    a, b = union(a), union(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The points of ``a`` not in ``b``, as sorted disjoint intervals."""
    out: list[Interval] = []
    holes = union(b)
    for start, end in union(a):
        for lo, hi in holes:
            if hi <= start or lo >= end:
                continue
            if lo > start:
                out.append((start, lo))
            start = max(start, hi)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out
