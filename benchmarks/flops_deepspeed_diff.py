"""DeepSpeed 0.19.8's flops profiler against zerolap's, on the same models and inputs:
``get_model_profile`` on each side, totals and per child module.

Run from the repo root: ``python benchmarks/flops_deepspeed_diff.py --deepspeed-python
/tmp/dsenv/bin/python`` (``benchmarks/deepspeed_diff.py --make-env`` makes that environment).
The models are defined here, in plain torch, so both libraries import the same code: a GPT
block stack (fused QKV, ``scaled_dot_product_attention``, GELU MLP, LayerNorm, tied head), the
same with attention written as matmuls and softmax, and a small CNN (convolutions, batch norm,
ReLU, pooling). Printed per model: parameters, MACs and flops on each side, and the children
whose MACs differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, fused: bool) -> None:
        super().__init__()
        self.heads, self.fused = heads, fused
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / (w // self.heads) ** 0.5
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)
            y = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, s, w))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, fused: bool) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads, fused)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, fused: bool, vocab=1024, seq=64, width=128, heads=4, layers=2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.Sequential(*(Block(width, heads, fused) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.head(self.ln(self.blocks(x)))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.classifier = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def models() -> dict:
    torch.manual_seed(0)
    tokens = torch.randint(0, 1024, (4, 64))
    return {
        "GPT, sdpa": (GPT(fused=True), tokens),
        "GPT, matmul + softmax": (GPT(fused=False), tokens),
        "CNN": (CNN().eval(), torch.randn(8, 3, 32, 32)),
    }


def run(out: str) -> None:
    """Both libraries run this: ``deepspeed`` is whichever one the python imports."""
    import importlib

    library = os.environ["PROFILER_LIBRARY"]
    if library == "zerolap":
        profiler = importlib.import_module("zerolap.profiling.flops")
    else:
        profiler = importlib.import_module("deepspeed.profiling.flops_profiler")
    results = {}
    for name, (model, batch) in models().items():
        with torch.no_grad():
            flops, macs, params = profiler.get_model_profile(
                model, args=[batch], print_profile=False, as_string=False, warm_up=1
            )
            children = {}
            for child_name, child in model.named_children():
                if isinstance(child, nn.Sequential | nn.ModuleList) and len(child) == 0:
                    continue
                prof = profiler.FlopsProfiler(model)
                prof.start_profile()
                model(batch)
                children[child_name] = _child_macs(profiler, prof, child)
                prof.end_profile()
        results[name] = {"flops": flops, "macs": macs, "params": params, "children": children}
    Path(out).write_text(json.dumps(results))


def _child_macs(profiler, prof, child) -> int:
    if hasattr(prof, "profile"):  # zerolap keeps counts in a profile object
        return prof.profile.macs(child)
    return profiler.get_module_macs(child)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed-python", required=True)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run(args.run)
        return 0
    results = {}
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        for library, python in (("deepspeed", args.deepspeed_python), ("zerolap", sys.executable)):
            out = str(Path(tmp) / f"{library}.json")
            command = [python, str(Path(__file__).resolve()), "--deepspeed-python", python]
            env = {
                **os.environ, "PROFILER_LIBRARY": library, "DS_ACCELERATOR": "cpu",
                "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1",
            }  # fmt: skip
            done = subprocess.run(
                [*command, "--run", out], capture_output=True, text=True, env=env, cwd=tmp
            )
            if done.returncode != 0:
                raise SystemExit(f"{library}:\n{(done.stdout + done.stderr)[-3000:]}")
            results[library] = json.loads(Path(out).read_text())
    print(
        "| model | params DS / zerolap | MACs DS / zerolap | flops DS / zerolap "
        "| children with other MACs |"
    )
    print("|---|---|---|---|---|")
    for name in results["zerolap"]:
        ds, zl = results["deepspeed"][name], results["zerolap"][name]
        differ = [
            f"{child} ({ds['children'][child]:,} / {zl['children'][child]:,})"
            for child in zl["children"]
            if ds["children"].get(child) != zl["children"][child]
        ]
        print(
            f"| {name} | {ds['params']:,} / {zl['params']:,} | {ds['macs']:,} / {zl['macs']:,} | "
            f"{ds['flops']:,} / {zl['flops']:,} ({zl['flops'] / ds['flops']:.3f}) | "
            f"{', '.join(differ) or 'none'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
