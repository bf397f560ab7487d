"""The same Hugging Face Trainer script under real DeepSpeed 0.19.8 and under zerolap, side by
side: per-step training and evaluation losses compared, and a checkpoint DeepSpeed wrote resumed
by zerolap through the Trainer's own ``resume_from_checkpoint``.

Real DeepSpeed lives in another virtual environment (it and zerolap's shim both answer
``import deepspeed``). Make one once, on CPU:

    python benchmarks/deepspeed_diff.py --make-env /tmp/dsenv

then compare (2 processes per run, tiny GPT-2 and Llama from ``save_pretrained`` folders):

    python benchmarks/deepspeed_diff.py --deepspeed-python /tmp/dsenv/bin/python

The script each side runs is ``tests/clients/hf_trainer.py`` (ds_config of "auto" values,
accumulation 2, evaluation and a checkpoint every 2 of 4 steps). It prints one table row per
comparison: the largest loss difference and both wall times; then Accelerate's sequence
parallelism (``--sp 2``) under both, with each one's gradient norms against plain DDP's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "clients" / "hf_trainer.py"
ENV_PACKAGES = [
    "deepspeed==0.19.8", "transformers==5.23.0", "accelerate==1.15.0", "tensorboard==2.21.0",
]  # fmt: skip


def make_env(path: Path) -> None:
    """A venv with torch's CPU wheel, then DeepSpeed (no compiled ops) and the clients."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    constraints = ROOT / "constraints.txt"
    env = {"DS_BUILD_OPS": "0", "PATH": str(path / "bin") + ":/usr/bin:/bin"}
    subprocess.run(
        [*pip, "-c", str(constraints), "--no-build-isolation", *ENV_PACKAGES], check=True, env=env
    )


def run(python: str, out: Path, args: list[str]) -> tuple[dict, float]:
    result = out.with_suffix(".json")
    command = [
        python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(SCRIPT), *args, "--out", str(out), "--result", str(result),
    ]  # fmt: skip
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads(result.read_text()), time.perf_counter() - start


def launch_ranks(
    python: str, script: Path, args: list[str], *, cwd: str, label: str, ranks: int = 2
) -> None:
    """``script`` with ``args`` on ``ranks`` ranks of ``python`` (torchrun, one thread each,
    DeepSpeed on its CPU accelerator, this repository importable); its output's tail on
    failure."""
    command = [
        python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
        str(script), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
    if done.returncode != 0:
        raise SystemExit(f"{label}:\n{(done.stdout + done.stderr)[-3000:]}")


def _gap(a: dict, b: dict, steps) -> float:
    return max(abs(a[str(s)] - b[str(s)]) for s in steps)


def pretrained(root: Path) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    from tests.clients.hf_trainer import tiny_config

    folders = {}
    for arch in ("gpt2", "llama"):
        torch.manual_seed(0)
        folders[arch] = root / arch
        AutoModelForCausalLM.from_config(tiny_config(arch)).save_pretrained(folders[arch])
    return folders


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed-python", help="a python with real DeepSpeed installed")
    parser.add_argument("--make-env", type=Path, help="create that environment here and stop")
    args = parser.parse_args()
    if args.make_env:
        make_env(args.make_env)
        return 0
    if not args.deepspeed_python:
        parser.error("give --deepspeed-python (see --make-env)")
    root = Path(tempfile.mkdtemp(prefix="deepspeed-diff-"))
    models = pretrained(root)
    rows = []
    for arch in ("gpt2", "llama"):
        for stage, optimizer in ((2, ["--ds-optimizer"]), (3, [])):
            flags = ["--model", str(models[arch]), "--stage", str(stage), *optimizer]
            name = f"{arch} stage {stage}"
            real, real_s = run(args.deepspeed_python, root / f"ds {name}", flags)
            ours, ours_s = run(sys.executable, root / f"zl {name}", flags)
            gap = max(
                _gap(real["losses"], ours["losses"], range(1, 5)),
                _gap(real["evals"], ours["evals"], (2, 4)),
            )
            rows.append((f"Trainer, {name}", gap, real_s, ours_s))
            # DeepSpeed's checkpoint-2 resumed by zerolap (the Trainer's resume path).
            resume = [*flags, "--resume", str(root / f"ds {name}" / "checkpoint-2")]
            resumed, resumed_s = run(sys.executable, root / f"zl resumed {name}", resume)
            gap = _gap(real["losses"], resumed["losses"], (3, 4))
            rows.append(
                (f"DeepSpeed's checkpoint-2 resumed by zerolap, {name}", gap, None, resumed_s)
            )
    print("| run | max abs loss difference | DeepSpeed 0.19.8 s | zerolap s |")
    print("|---|---|---|---|")
    for name, gap, real_s, ours_s in rows:
        real = "-" if real_s is None else f"{real_s:.1f}"
        print(f"| {name} | {gap:.1e} | {real} | {ours_s:.1f} |")
    print()
    print(sequence_parallel(args.deepspeed_python, root, models["llama"]))
    return 0


def sequence_parallel(python: str, root: Path, model: Path) -> str:
    """Accelerate's Ulysses path (``sp_size`` 2 over both ranks, each step accumulating the two
    ranks' batches), with the gradient norms each library reports beside those of plain DDP
    over the same batches: the gradient of the loss is that norm."""
    plain, _ = run(sys.executable, root / "plain llama", ["--model", str(model), "--gas", "1"])
    lines = [
        "| Ulysses, sp 2 | max abs loss difference | grad norm / DDP's: DeepSpeed 0.19.8 | "
        "zerolap | DeepSpeed s | zerolap s |",
        "|---|---|---|---|---|---|",
    ]
    for stage in (2, 3):
        flags = ["--model", str(model), "--stage", str(stage), "--sp", "2", "--gas", "2"]
        real, real_s = run(python, root / f"ds sp {stage}", flags)
        ours, ours_s = run(sys.executable, root / f"zl sp {stage}", flags)
        gap = max(
            _gap(real["losses"], ours["losses"], range(1, 5)),
            _gap(real["evals"], ours["evals"], (2, 4)),
        )
        ratios = [
            max(r["grad_norms"][str(s)] / plain["grad_norms"][str(s)] for s in range(1, 5))
            for r in (real, ours)
        ]
        lines.append(
            f"| ZeRO {stage} | {gap:.1e} | {ratios[0]:.4f} | {ratios[1]:.4f} | {real_s:.1f} "
            f"| {ours_s:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
