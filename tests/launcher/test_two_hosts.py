"""Two hosts, made on this machine as two network namespaces joined by a veth pair, each with
its own address: ``zerolap run --nnodes 2 --node-rank R --master-addr A --master-port P`` on
each, 2 ranks per host, through torchrun's rendezvous across the link. At stages 2 and 3 the
trained parameters equal those of the same job on one host, and the bytes each host sent on its
interface match what the ring collectives must carry across (the ring 0-1-2-3 crosses between
the hosts on two of its four links). A rank killed on one host makes the other host's ranks
exit with ``CommError``. Needs root and iproute2; skipped elsewhere."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launcher.hosts_script import STEPS, train
from tests.multiproc import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "hosts_script.py"
TIMEOUT = 180


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def hosts():
    """[(namespace, address, interface)] for hosts A and B, removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = os.getpid() % 100_000
    subnet = f"10.{100 + tag % 100}.{tag % 250}"
    made = [(f"zlA{tag}", f"{subnet}.1", f"vzA{tag}"), (f"zlB{tag}", f"{subnet}.2", f"vzB{tag}")]
    try:
        for namespace, _, _ in made:
            _ip("netns", "add", namespace)
        _ip("link", "add", made[0][2], "type", "veth", "peer", "name", made[1][2])
        for namespace, address, interface in made:
            _ip("link", "set", interface, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", namespace, "link", "set", interface, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as err:
        for namespace, _, _ in made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {err.stderr.strip()}")
    yield made
    for namespace, _, _ in made:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def _env(interface: str) -> dict:
    # gloo's address: the host's own, not loopback
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": interface,
    }


def _run(prefix: list[str], env: dict, flags: list[str], script_args: list[str]):
    return subprocess.Popen(
        [*prefix, sys.executable, "-m", "zerolap.cli", "run", *flags, str(SCRIPT), *script_args],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its ranks too are killed at the deadline
    )  # fmt: skip


def two_hosts(hosts, out: Path, stage: int, kill: int = -1) -> list[tuple[int, str]]:
    """Both launchers' exit codes and output."""
    out.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    master = ["--master-addr", hosts[0][1], "--master-port", port]
    launchers = [
        _run(
            ["ip", "netns", "exec", namespace],
            _env(interface),
            ["-n", "2", "--nnodes", "2", "--node-rank", str(node), *master],
            ["--stage", str(stage), "--out", str(out), "--kill", str(kill)],
        )
        for node, (namespace, _, interface) in enumerate(hosts)
    ]
    return [_finish(launcher) for launcher in launchers]


def _finish(launcher: subprocess.Popen) -> tuple[int, str]:
    """Exit code and output, read as it comes (a full pipe would stall the launcher); killed
    at the deadline."""
    try:
        output, _ = launcher.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        output, _ = launcher.communicate()
    return launcher.returncode, output


@pytest.mark.parametrize("stage", [2, 3])
def test_two_hosts_train_as_one_and_send_what_the_ring_carries(hosts, ranks, tmp_path, stage):
    results = two_hosts(hosts, tmp_path / "two", stage)
    for code, output in results:
        assert code == 0, output[-3000:]
    # The same job on one host: 4 ranks of this session's pool on loopback.
    one, _ = ranks(4).run(train, stage, -1, False, timeout=180)[0]
    two = torch.load(tmp_path / "two" / "params.pt")
    assert all(torch.equal(a, b) for a, b in zip(two, one, strict=True))
    traffic = json.loads((tmp_path / "two" / "traffic.json").read_text())
    # Ring op of K bytes on 4 ranks: each rank sends 3 of the 4 chunks to its right
    # neighbour; ranks 1 and 3 send theirs to the other host: 2 x (3/4) K cross.
    message = traffic[0]["ring_message_bytes"]
    crossing = traffic[1]["ring_sent"] + traffic[3]["ring_sent"]
    assert abs(crossing - 1.5 * message) <= 0.01 * message, (crossing, message)
    # What the interfaces sent: the ring's crossing bytes, plus headers, acknowledgements and
    # the engine's few small collectives (measured: 0.6% more).
    sent = traffic[0]["interface_sent"] + traffic[2]["interface_sent"]
    per_rank_step = sent / len(traffic) / STEPS
    print(  # the README's figures (pytest -s)
        f"stage {stage}: ring crossing {crossing} B = {crossing / message:.4f} K; interfaces "
        f"sent {sent} B = {sent / crossing:.4f}x that, {per_rank_step / 1e6:.2f} MB/rank/step"
    )
    assert crossing <= sent <= 1.05 * crossing, (sent, crossing)


def test_a_rank_killed_on_one_host_fails_the_other_host(hosts, tmp_path):
    (code_a, output_a), (code_b, _) = two_hosts(hosts, tmp_path, stage=2, kill=3)
    assert code_a != 0 and code_b != 0
    assert "CommError" in output_a, output_a[-3000:]
    # Rank 3 dies; host B's launcher then stops rank 2 too, so host A may hear of either first.
    assert re.search(r"rank [23] closed the connection", output_a), output_a[-3000:]
