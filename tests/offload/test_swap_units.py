"""The disk tier's parts on their own: swap files (round trip, named errors for a file cut short,
changed underneath, never written, a full disk), sub-groups, the optimizer's swapped state and the
parameter chunk cache."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from zerolap.config import ConfigError
from zerolap.offload.optimizer_swap import Field, SwappedState
from zerolap.offload.param_swap import ParamSwapPlan
from zerolap.offload.swap_file import SwapError, SwapFile, aligned_empty
from zerolap.zero.layout import OwnedRun
from zerolap.zero.sub_groups import GroupEntries, split_runs


def _filled(values: torch.Tensor) -> torch.Tensor:
    buffer = aligned_empty(values.numel() * values.element_size())
    buffer[: values.numel() * values.element_size()].view(values.dtype).copy_(values)
    return buffer


def test_round_trip_and_removal(tmp_path):
    values = torch.randn(3000)
    swap = SwapFile(tmp_path / "a.swap", 2 * 4096 + 12000)
    swap.write(8192, _filled(values), values.numel() * 4)
    out = aligned_empty(12000)
    swap.read(8192, out, 12000)
    assert torch.equal(out[:12000].view(torch.float32), values)
    assert (tmp_path / "a.swap").exists()
    swap.close()
    assert not (tmp_path / "a.swap").exists()


def test_named_errors_for_bad_files(tmp_path):
    path = tmp_path / "b.swap"
    swap = SwapFile(path, 8192)
    out = aligned_empty(4096)
    with pytest.raises(SwapError, match="never written"):
        swap.read(0, out, 4096)
    swap.write(4096, _filled(torch.arange(1024.0)), 4096)
    with open(path, "r+b") as f:  # a byte changed underneath
        f.seek(4100)
        f.write(b"\x01")
    with pytest.raises(SwapError, match=f"{path}.*checksum mismatch"):
        swap.read(4096, out, 4096)
    os.truncate(path, 4096)  # cut short
    with pytest.raises(SwapError, match=f"{path}.*cut short"):
        swap.read(4096, out, 4096)
    with pytest.raises(SwapError, match="cut short"):
        swap.check_size()
    swap.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB filesystem (needs the right to mount; skipped elsewhere)."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    yield where
    subprocess.run(["umount", str(where)], check=False)


def test_a_full_disk_fails_at_construction_naming_the_file(small_tmpfs):
    needs = r"big\.swap: No space left .*needs 8388608 bytes, 1048576 free"
    with pytest.raises(SwapError, match=f"cannot allocate swap file .*{needs}"):
        SwapFile(small_tmpfs / "big.swap", 8 << 20)
    assert os.listdir(small_tmpfs) == []  # nothing left behind


def test_split_runs_cuts_exactly():
    runs = [
        OwnedRun(bucket=0, start=0, end=7, group=0),
        OwnedRun(bucket=1, start=20, end=25, group=1),
    ]
    out, positions, groups = split_runs(runs, [0, 7], 4)
    assert [(r.start, r.end) for r in out] == [(0, 4), (4, 7), (20, 21), (21, 25)]
    assert positions == [0, 4, 7, 8]
    assert [(list(g.runs), g.numel) for g in groups] == [([0], 4), ([1, 2], 4), ([3], 4)]
    out, _, groups = split_runs(runs, [0, 7], 0)  # every run its own sub-group
    assert [g.numel for g in groups] == [7, 5] and len(out) == 2
    # Pieces of at most 3 (cache-sized on the CPU) inside sub-groups of 4 and of whole runs.
    out, positions, groups = split_runs(runs, [0, 7], 4, piece_numel=3)
    assert [(r.start, r.end) for r in out] == [(0, 3), (3, 4), (4, 7), (20, 21), (21, 24), (24, 25)]
    assert positions == [0, 3, 4, 7, 8, 11]
    assert [(list(g.runs), g.numel) for g in groups] == [([0, 1], 4), ([2, 3], 4), ([4, 5], 4)]
    out, _, groups = split_runs(runs, [0, 7], 0, piece_numel=3)
    assert [len(g.runs) for g in groups] == [3, 2] and [g.numel for g in groups] == [7, 5]


def check_cpu_steps_in_pieces() -> tuple[int, int]:
    """The default bucket (5e8) puts a whole layer in one run: stepped on the CPU it is cut
    into cache-sized pieces, and the parameters come out as they would whole."""
    import zerolap
    from zerolap.zero.optimizer import STEP_PIECE_NUMEL

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 700)  # weight and bias, one run of 717,500: 3 pieces
    reference = torch.nn.Linear(1024, 700)
    reference.load_state_dict(model.state_dict())
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0}
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    engine, *_ = zerolap.initialize(model=model, optimizer=opt, config=config)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.01)
    for step in range(3):
        x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).square().mean())
        engine.step()
        ref_opt.zero_grad()
        reference(x).square().mean().backward()
        ref_opt.step()
    pieces = engine.optimizer.runs
    assert max(r.end - r.start for r in pieces) <= STEP_PIECE_NUMEL
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, want)
    return len(pieces), sum(r.end - r.start for r in pieces)


def test_runs_stepped_on_the_cpu_are_cut_into_pieces(ranks):
    count, numel = ranks(1).run(check_cpu_steps_in_pieces)[0]
    assert (count, numel) == (3, 1024 * 700 + 700)


def test_swapped_state_streams_through_its_buffers(tmp_path):
    runs = [OwnedRun(bucket=0, start=0, end=10, group=0)]
    _, _, groups = split_runs(runs, [0], 3)
    fields = [Field("exp_avg", torch.float32), Field("step_count", torch.float64)]
    numels = [3, 3, 3, 1]
    state = SwappedState(
        path=tmp_path / "s.swap",
        sub_groups=groups,
        run_numels=numels,
        fields=fields,
        buffer_count=2,
    )
    assert len(state.buffers) == 2
    state.begin_pass()
    for position in range(len(groups)):
        opened = state.open(position)
        assert opened.fresh
        opened.fields[0]["exp_avg"].fill_(position)
        opened.fields[0]["step_count"].fill_(10 + position)
        state.close(position, stateful=True)
    state.drain()
    for position, opened in zip(range(4), state.visit(list(range(4))), strict=True):
        assert not opened.fresh
        assert torch.all(opened.fields[0]["exp_avg"] == position)
        assert torch.all(opened.fields[0]["step_count"] == 10 + position)
    os.truncate(state.file.path, 100)
    with pytest.raises(SwapError, match="cut short"):
        state.begin_pass()
    state.close_file()
    assert not (tmp_path / "s.swap").exists()


def test_param_chunks_are_cached_in_buffer_count_buffers(tmp_path):
    plan = ParamSwapPlan(directory=tmp_path, rank=0, buffer_count=2, buffer_size=100, max_in_cpu=5)
    # Unit 0 fits max_in_cpu, unit 1 is kept whole (persistent), units 2-4 are swapped.
    assert plan.choose([5, 50, 40, 40, 40], [False, True, False, False, False]) == [2, 3, 4]
    with pytest.raises(ConfigError, match=r"buffer_size 100 .* unit holding blocks\.7"):
        plan.build({7: 101}, torch.float32, {7: "blocks.7"})
    chunks = plan.build({2: 40, 3: 40, 4: 40}, torch.float32, {})
    for unit in (2, 3, 4):
        chunks.get(unit, write=True).fill_(unit)
    assert chunks.buffer_bytes() == 2 * 4096 and chunks.writes == 1  # unit 2 went out for 4
    for unit in (2, 3, 4, 2):
        assert torch.all(chunks.get(unit, write=False) == unit)
    chunks.flush()
    assert chunks.writes == 3
    chunks.close()
    assert os.listdir(tmp_path) == []


def test_staged_chunks_stay_pinned_until_copied_and_a_failed_read_breaks_the_swap(tmp_path):
    import threading

    plan = ParamSwapPlan(directory=tmp_path, rank=0, buffer_count=2, buffer_size=100, max_in_cpu=0)
    chunks = plan.build({0: 40, 1: 40, 2: 40}, torch.float32, {})
    for unit in (0, 1, 2):
        chunks.get(unit, write=True).fill_(unit)
    chunks.flush()
    take = [chunks.stage(0), chunks.stage(1)]  # both buffers pinned, reads in flight
    assert chunks.staged_reads == 2
    taken = threading.Event()

    def third():  # needs a buffer: waits for a gather to copy its chunk in
        assert torch.all(chunks.get(2, write=False) == 2)
        taken.set()

    waiter = threading.Thread(target=third)
    waiter.start()
    assert not taken.wait(0.3)  # nothing unpinned yet
    assert torch.all(take[0]() == 0) and torch.all(take[1]() == 1)
    chunks.unpin(0)
    assert taken.wait(5)
    waiter.join()
    chunks.unpin(1)
    # A chunk changed underneath: its staged read fails in the gather, and the swap is broken
    # from then on; the half-read chunk is never served or written back.
    path = next(tmp_path.iterdir())
    chunks.flush()
    with open(path, "r+b") as f:
        f.seek(4096 + 8)
        f.write(b"\x01")
    staged = chunks.stage(1)
    with pytest.raises(SwapError, match="checksum mismatch"):
        staged()
    chunks.unpin(1)
    writes = chunks.writes
    for use in (lambda: chunks.get(1, write=True), lambda: chunks.stage(0), chunks.flush):
        with pytest.raises(SwapError, match="checksum mismatch"):
            use()
    assert chunks.writes == writes
    chunks.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(60)  # the fault this guards against is a wait that never ends
def test_a_chunk_that_fails_its_read_breaks_the_swap_and_frees_its_buffer(tmp_path):
    """With one buffer, a chunk read in place that fails its checksum must not keep the
    buffer: every later use raises the first error instead of waiting for a buffer forever."""
    plan = ParamSwapPlan(directory=tmp_path, rank=0, buffer_count=1, buffer_size=100, max_in_cpu=0)
    chunks = plan.build({0: 40, 1: 40}, torch.float32, {})
    for unit in (0, 1):
        chunks.get(unit, write=True).fill_(unit)
    chunks.flush()
    chunks.get(0, write=False)  # unit 1 goes out of the one buffer
    with open(next(tmp_path.iterdir()), "r+b") as f:
        f.seek(4096 + 8)
        f.write(b"\x01")
    with pytest.raises(SwapError, match=r"the \d+ bytes at 4096 .*checksum mismatch") as first:
        chunks.get(1, write=False)
    for use in (lambda: chunks.get(0, write=False), lambda: chunks.stage(0), chunks.flush):
        with pytest.raises(SwapError) as later:
            use()
        assert str(later.value) == str(first.value)
    chunks.close()


def test_group_entries_come_back_as_the_same_objects_with_their_values():
    # A scheduler holding a tensor learning rate must keep steering the group after a
    # sub-group's call; a counter the call added goes, one it advanced in place comes back.
    lr = torch.tensor(0.1)
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))], lr=lr)
    group = optimizer.param_groups[0]
    group["count"] = torch.tensor(3)
    entries = GroupEntries(optimizer)
    group["count"] += 1  # in place
    group["step"] = 1  # added
    group["lr"] = torch.tensor(9.0)  # replaced
    entries.restore()
    assert "step" not in group and group["count"].item() == 3
    assert group["lr"] is lr and lr.item() == pytest.approx(0.1)
