"""The main job end to end on 2 processes: it trains, reports, and writes its trace and PNG."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.comm.test_env import LAUNCHERS
from tests.multiproc import free_port, run_on_ranks
from zerolap.cli import main
from zerolap.demo.train import DemoOptions, run_demo


def short_demo(out_dir: str) -> dict:
    return run_demo(DemoOptions(stage=2, steps=30, out_dir=out_dir))


def test_demo_trains_and_writes_its_outputs(tmp_path):
    summaries = run_on_ranks(
        short_demo, 2, str(tmp_path), env=LAUNCHERS["torchrun"], init=False, timeout=240
    )
    losses = summaries[0]["losses"]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < losses[0] - 0.5  # the loss falls
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}  # one process per rank
    assert {e["tid"] for e in events} == {0, 1}  # compute and comm lanes
    names = {e["name"] for e in events}
    assert {"forward", "backward", "optimizer", "ring_reduce_scatter", "ring_all_gather"} <= names
    assert any(n.startswith("backward:block") for n in names)  # per-block spans
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "summary.json").read_text())
    for rank_memory in summary["memory"]:
        assert abs(rank_memory["total_bytes"] / rank_memory["expected_bytes"] - 1) < 0.05
    assert abs(summary["wire_bytes_per_step"] / summary["wire_theory_bytes"] - 1) < 0.05
    assert 0.0 <= summary["overlap"]["eta"] <= 1.0


def _zerolap(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zerolap.cli", *args], capture_output=True, text=True, timeout=240
    )


def _zerolap_here(capsys, *args: str) -> tuple[int, str, str]:
    """A command that launches nothing, run in this process (the entry point's own exit
    status is checked once, by subprocess, in ``test_cli_bad_arguments_are_named``)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_demo_runs_through_the_launcher(tmp_path):
    result = _zerolap("demo", "--steps", "3", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bytes sent per step per rank" in result.stdout
    assert (tmp_path / "timeline.png").exists()


def test_cli_demo_with_offload_reports_what_was_swapped(tmp_path):
    result = _zerolap(
        "demo", "--steps", "3", "--stage", "3", "--offload", "nvme", "--out", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("swapped to disk") == 2  # one line per rank
    assert list((tmp_path / "swap").iterdir()) == []  # scratch files removed at the end
    summary = json.loads((tmp_path / "summary.json").read_text())
    for memory in summary["memory"]:
        assert memory["params_bytes"] < memory["swapped_bytes"]


def test_cli_demo_with_tensor_parallelism_shows_its_all_reduces(tmp_path):
    """TP 2 x DP 2 on 4 processes: the TP all-reduces on their own timeline lane, their figures
    per pass, the step against the same step with them skipped, a sample from split logits."""
    result = _zerolap(
        "demo", "--steps", "4", "--world-size", "4", "--tp", "2", "--out", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TP 2 x DP 2" in result.stdout
    assert "tensor-parallel all-reduces skipped" in result.stdout
    trace = json.loads((tmp_path / "trace.json").read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["tid"] == 2}
    assert lanes == {"tp comm"}
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 2}
    assert names == {"tp_forward_all_reduce", "tp_backward_all_reduce"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    overlap = summary["overlap"]
    for kind in ("tp_forward", "tp_backward"):
        assert overlap[f"{kind}_bytes"] > 0 and 0.0 <= overlap[f"{kind}_eta"] <= 1.0
        assert overlap[f"{kind}_exposed_s"] <= overlap[f"{kind}_comm_s"] + 1e-3
    assert summary["sample"].startswith("ZeRO ")
    # ZeRO's own traffic, over the data-parallel pairs, still matches its theory.
    assert abs(summary["wire_bytes_per_step"] / summary["wire_theory_bytes"] - 1) < 0.05


def test_cli_run_launches_a_deepspeed_style_script(tmp_path):
    """``zerolap run`` hands the unchanged DeepSpeed-style example to torchrun."""
    result = _zerolap(
        "run",
        "-n",
        "2",
        "--master-port",
        str(free_port()),
        "examples/train_gpt.py",
        "--deepspeed_config",
        "examples/ds_config_zero2.json",
        "--steps",
        "4",
        "--save_dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: 2 optimizer steps, 32 samples" in result.stdout
    assert (tmp_path / "latest").read_text() == "global_step2"


def test_cli_bad_arguments_are_named(capsys):
    cases = [
        (["demo", "--stage", "4"], "--stage must be 0, 1, 2 or 3, got 4"),
        (["demo", "--world-size", "0"], "--world-size must be >= 1, got 0"),
        (["demo", "--model-size", "huge"], "--model-size must be one of tiny, small"),
        (["demo", "--config", "/nonexistent.json"], "--config /nonexistent.json: no such file"),
        (["demo", "--tp", "3"], "--tp 3 does not divide --world-size 2"),
        (["demo", "--config", __file__, "--tp", "2"], "with --config, set its tensor_parallel"),
        (["estimate"], "give exactly one of --params N and --model module:factory"),
        (["estimate", "--params", "1e9", "--world", "0"], "world size must be >= 1"),
        (["estimate", "--model", "nomodule"], "--model must look like module:factory"),
        (["estimate", "--model", "no_such_module:f"], "No module named 'no_such_module'"),
        (["run", "missing.py"], "missing.py: no such script"),
        (["run", "--master-port", "0", "x.py"], "--master-port must be a port in 1..65535, got 0"),
    ]
    for argv, message in cases:
        code, _, err = _zerolap_here(capsys, *argv)
        assert code == 2, (argv, err)
        assert message in err, (argv, err)
    # Through ``python -m zerolap.cli``: the status reaches the shell.
    result = _zerolap(*cases[0][0])
    assert result.returncode == 2 and cases[0][1] in result.stderr, result.stderr


def test_cli_estimate_and_report(capsys):
    code, out, err = _zerolap_here(
        capsys, "estimate", "--params", "1e9", "--world", "4", "--precision", "bf16-masters"
    )
    assert code == 0, err
    assert "ZeRO stage 0: (bf16-masters needs stage 1-3)" in out
    assert "ZeRO stage 2:      3.500 GB   (bf16-masters: no offload)" in out
    code, out, err = _zerolap_here(capsys, "estimate", "--params", "7.5e9", "--world", "64")
    assert code == 0
    for line in (
        "ZeRO stage 0:    120.000 GB",
        "ZeRO stage 1:     31.406 GB",
        "ZeRO stage 2:     16.641 GB",
        "ZeRO stage 3:      1.875 GB",
    ):
        assert line in out
    # offload columns: stage 2 moves the 12 bytes of master + Adam state and the 2 of the
    # gradient shard over 64 ranks to the host (nvme: the 12 to disk, the 2 to the host)
    stage2 = next(ln for ln in out.splitlines() if "ZeRO stage 2:" in ln)
    assert stage2.split()[5:9] == ["15.000", "GB", "1.641", "GB"], stage2
    assert stage2.split()[9:15] == ["15.000", "GB", "234.375", "MB", "1.406", "GB"], stage2
    code, out, err = _zerolap_here(
        capsys,
        "estimate",
        "--model",
        "tests.demo.test_demo:two_layer",
        "--world",
        "2",
        "--precision",
        "fp32",
    )
    assert code == 0 and "116 parameters" in out
    assert "ZeRO stage 0:      1.856 KB" in out  # 116 x 16 bytes
    assert "ZeRO stage 3:        928 B" in out  # 116 x 16 / 2
    code, out, _ = _zerolap_here(capsys, "report")
    assert code == 0 and "backend gloo" in out


def two_layer():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(4, 10), torch.nn.Linear(10, 6))
