"""Overlap figures on synthetic spans whose answers are known by hand."""

from __future__ import annotations

import pytest

from zerolap.profiling.intervals import covered, intersection_length, subtract, union
from zerolap.profiling.overlap import overlap_stats


def test_union_merges_touching_and_drops_empty():
    assert union([(3, 4), (0, 1), (1, 2), (5, 5), (3.5, 6)]) == [(0, 2), (3, 6)]
    assert covered([(0, 2), (1, 3), (10, 11)]) == 4


def test_intersection_length():
    assert intersection_length([(0, 10)], [(2, 3), (9, 12)]) == 2
    assert intersection_length([(0, 1), (2, 3)], [(1, 2)]) == 0
    assert intersection_length([], [(0, 1)]) == 0


def test_subtract_cuts_holes_out_of_intervals():
    # A forward span with two waits inside it, one wait overhanging its end, one outside.
    got = subtract([(0, 10), (20, 30)], [(2, 3), (5, 6), (9, 12), (40, 50)])
    assert got == [(0, 2), (3, 5), (6, 9), (20, 30)]
    assert subtract([(0, 4)], [(0, 4)]) == []
    assert subtract([(0, 4)], []) == [(0, 4)]


def test_fully_hidden_communication():
    # |---compute 0..10---|
    #     |--comm 2..6--|
    s = overlap_stats([(0, 10)], [(2, 6)], step=(0, 10))
    assert (s.compute_s, s.comm_s, s.exposed_comm_s, s.eta) == (10, 4, 0, 1.0)
    assert (s.ideal_s, s.serial_s) == (10, 14)


def test_fully_exposed_communication():
    # |--compute 0..4--|--All-Reduce 4..7--|
    s = overlap_stats([(0, 4)], [(4, 7)], step=(0, 7))
    assert (s.exposed_comm_s, s.eta, s.step_s, s.ideal_s, s.serial_s) == (3, 0.0, 7, 4, 7)


def test_partial_overlap_with_overlapping_comm_spans():
    # compute 0..5 and 6..8; comm 3..7 and 4..9 (two buckets in flight at once)
    # comm union 3..9 = 6; hidden: 3..5 and 6..8 = 4; exposed 2.
    s = overlap_stats([(0, 5), (6, 8)], [(3, 7), (4, 9)], step=(0, 9))
    assert s.comm_s == 6 and s.hidden_comm_s == 4 and s.exposed_comm_s == 2
    assert s.eta == pytest.approx(4 / 6)
    assert s.compute_s == 7


def test_spans_are_clipped_to_the_step_and_no_comm_means_eta_one():
    s = overlap_stats([(-5, 2)], [(1, 20)], step=(0, 4))
    assert (s.compute_s, s.comm_s, s.exposed_comm_s) == (2, 3, 2)
    assert overlap_stats([(0, 1)], [], step=(0, 1)).eta == 1.0


def test_exposure_per_kind_from_the_records():
    """T_comm is the union of the collectives' spans, exposed the union of the waits on them."""
    from zerolap.comm.logger import CommRecord
    from zerolap.profiling.overlap import exposure

    def record(op, start, end, waited=None, size=100):
        return CommRecord(op, size, size, 2, start, end, waited=waited)

    records = [
        record("tp_forward_all_reduce", 0.0, 2.0, waited=(1.5, 2.0)),
        record("tp_forward_all_reduce", 1.0, 3.0, waited=(2.5, 3.0)),  # queued behind the first
        record("tp_backward_all_reduce", 5.0, 6.0),  # never waited for: fully hidden
        record("tp_backward_all_reduce", 7.0, None),  # not completed: not counted
        record("all_reduce", 0.0, 9.0, waited=(0.0, 9.0)),
    ]
    got = exposure(records, ("tp_forward_all_reduce", "tp_backward_all_reduce"))
    forward, backward = got["tp_forward_all_reduce"], got["tp_backward_all_reduce"]
    assert (forward.count, forward.message_bytes) == (2, 200)
    assert forward.comm_s == pytest.approx(3.0) and forward.exposed_s == pytest.approx(1.0)
    assert forward.eta == pytest.approx(2 / 3)
    assert (backward.count, backward.comm_s, backward.exposed_s, backward.eta) == (1, 1.0, 0.0, 1.0)
