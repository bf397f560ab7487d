"""The comms logger: what it records per op, the summary it prints, and that timing an async op
does not wait for it."""

from __future__ import annotations

import time

import pytest
import torch

import zerolap.comm as dist
from zerolap.comm.logger import COMMS_LOGGER, configure, format_summary
from zerolap.comm.volume import bus_factor, ring_wire_bytes
from zerolap.config.comms_logger import CommsLoggerConfig


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather_into_tensor", 4) == pytest.approx(0.75)
    assert bus_factor("reduce_scatter_tensor", 2) == pytest.approx(0.5)
    assert bus_factor("ring_all_reduce", 2) == pytest.approx(1.0)
    for op in ("broadcast", "reduce", "isend", "irecv"):
        assert bus_factor(op, 8) == 1.0


def test_ring_wire_bytes_per_rank():
    assert ring_wire_bytes("all_reduce", 4000, 4) == 6000
    assert ring_wire_bytes("all_gather", 4000, 4) == 3000
    assert ring_wire_bytes("reduce_scatter_tensor", 4000, 4) == 3000
    assert ring_wire_bytes("all_reduce", 4000, 1) == 0
    # A broadcast chain from root 1 over 4 ranks: rank 0 (before the root) is the tail.
    assert [ring_wire_bytes("broadcast", 100, 4, group_rank=r, root=1) for r in range(4)] == [
        0,
        100,
        100,
        100,
    ]
    assert [ring_wire_bytes("reduce", 100, 4, group_rank=r, root=2) for r in range(4)] == [
        100,
        100,
        0,
        100,
    ]
    assert ring_wire_bytes("isend", 64, 2) == 64 and ring_wire_bytes("irecv", 64, 2) == 0


def test_configure_from_ds_config_and_keywords():
    try:
        cfg = configure(
            {"comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"]}},
            verbose=True,
        )
        assert cfg == CommsLoggerConfig(
            enabled=True, prof_all=False, prof_ops=["all_reduce"], verbose=True
        )
        assert COMMS_LOGGER.enabled and COMMS_LOGGER.wants("all_reduce")
        assert not COMMS_LOGGER.wants("broadcast")
        with pytest.raises(ValueError, match="prof_alll"):
            configure({"prof_alll": True})
    finally:
        configure(CommsLoggerConfig())
    assert not COMMS_LOGGER.enabled


def test_summary_table_has_the_deepspeed_columns():
    table = format_summary(
        {
            "all_reduce": {
                4096: {
                    "count": 2,
                    "total_latency_ms": 3.0,
                    "avg_latency_ms": 1.5,
                    "algbw_gbps": 0.1,
                    "busbw_gbps": 0.1,
                    "wire_bytes": 8192,
                }
            }
        }
    )
    header = table.splitlines()[0]
    for column in (
        "Comm. Op",
        "Message Size",
        "Count",
        "Total Latency(ms)",
        "Avg Latency(ms)",
        "algbw (GB/s)",
        "busbw (GB/s)",
    ):
        assert column in header
    assert "all_reduce" in table and "4.00 KB" in table


def check_logged_ops():
    n = dist.get_world_size()
    dist.configure(enabled=True, prof_all=True)
    dist.reset_log()
    try:
        for _ in range(3):
            dist.all_reduce(torch.ones(1024))
        dist.all_gather_into_tensor(torch.empty(256 * n), torch.ones(256))
        dist.broadcast(torch.ones(100), src=0)
        summary = dist.log_summary(show_straggler=True)
        ar = summary["all_reduce"][4096]
        assert ar["count"] == 3
        assert ar["wire_bytes"] == 3 * 2 * 4096 * (n - 1) // n
        assert ar["busbw_gbps"] == pytest.approx(ar["algbw_gbps"] * 2 * (n - 1) / n)
        assert ar["algbw_gbps"] == pytest.approx(4096 / (ar["avg_latency_ms"] / 1e3) / 1e9)
        assert "straggler_ms" in ar
        ag = summary["all_gather_into_tensor"][1024 * n]  # message = the gathered output
        assert ag["count"] == 1 and ag["wire_bytes"] == 1024 * (n - 1)
        assert summary["broadcast"][400]["count"] == 1
        dist.reset_log()  # a caller's log name keeps the collective's bus factor
        dist.all_reduce(torch.ones(1024), log_name="tp_forward_all_reduce")
        named = dist.log_summary()["tp_forward_all_reduce"][4096]
        assert named["busbw_gbps"] == pytest.approx(named["algbw_gbps"] * 2 * (n - 1) / n)
        dist.configure(prof_all=False, prof_ops=["broadcast"])
        dist.reset_log()
        dist.all_reduce(torch.ones(8))
        dist.broadcast(torch.ones(8), src=0)
        assert [r.op for r in COMMS_LOGGER.records] == ["broadcast"]
        dist.configure(enabled=False, prof_all=True, prof_ops=[])
        dist.all_reduce(torch.ones(8))
        assert len(COMMS_LOGGER.records) == 1  # disabled: nothing recorded
    finally:
        dist.configure(enabled=False)
        dist.reset_log()


def check_async_op_timed_without_waiting():
    rank = dist.get_rank()
    dist.configure(enabled=True)
    dist.reset_log()
    try:
        tensor = torch.full((1 << 21,), float(rank))
        handle = dist.all_reduce(tensor, async_op=True)
        record = COMMS_LOGGER.records[-1]
        deadline = time.monotonic() + 30
        # The op runs on gloo's threads and the record closes on completion, before any wait().
        while record.end is None:
            assert time.monotonic() < deadline, "async all_reduce made no progress without wait"
            time.sleep(0.005)
        # torch completes the future (running the callback that closed the record) before it
        # flags the work done, so is_completed() may still be False here: the reduced result
        # already in place is what shows the op had finished.
        assert torch.equal(tensor, torch.full_like(tensor, float(sum(range(2)))))
        end = record.end
        handle.wait()
        assert record.end == end  # wait() does not re-time a completed op
        return record.latency
    finally:
        dist.configure(enabled=False)
        dist.reset_log()


def check_debug_names_the_caller():
    dist.configure(enabled=True, debug=True)
    dist.reset_log()
    try:
        dist.all_reduce(torch.ones(2))
        return COMMS_LOGGER.records[-1].op
    finally:
        dist.configure(enabled=False, debug=False)
        dist.reset_log()


@pytest.mark.parametrize("world_size", [2, 4])
def test_logged_ops(ranks, world_size):
    ranks(world_size).run(check_logged_ops)


def test_async_op_is_timed_at_completion_without_wait(ranks):
    latencies = ranks(2).run(check_async_op_timed_without_waiting)
    assert all(lat > 0 for lat in latencies)


def test_debug_adds_the_caller(ranks):
    ops = ranks(2).run(check_debug_names_the_caller)
    assert ops == ["all_reduce | [Caller Func: check_debug_names_the_caller]"] * 2


def test_chunking_is_even_and_covers_everything():
    from zerolap.comm.chunking import even_chunks

    assert even_chunks(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert even_chunks(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert even_chunks(0, 2) == [(0, 0), (0, 0)]
    with pytest.raises(ValueError, match="0 chunks"):
        even_chunks(5, 0)
