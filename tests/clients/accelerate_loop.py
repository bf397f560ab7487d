"""An Accelerate training loop with a ``DeepSpeedPlugin`` (or without, for the reference),
launched by torchrun from ``test_accelerate.py``: ``accelerator.accumulate`` over 2
micro-batches, ``accelerator.backward``, ``clip_grad_norm_`` and the usual optimizer calls, as a
user writes them. Rank 0 writes the per-micro-batch losses (mean over ranks) as JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=-1, help="-1: no DeepSpeed")
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    PartialState(cpu=True, backend="gloo")  # on a CPU-only host Accelerate counts ranks only so
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 16, generator=generator), torch.randn(64, 1, generator=generator)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    plugin = None
    if args.stage >= 0:
        plugin = DeepSpeedPlugin(
            zero_stage=args.stage, gradient_accumulation_steps=2, gradient_clipping=1.0
        )
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, norms = [], []
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
    if accelerator.is_main_process:
        with open(args.result, "w") as f:
            json.dump({"losses": losses, "norms": norms}, f)
    # Interpreter exit tears gloo's threads down in an order that sometimes aborts a rank
    # ("terminate called without an active exception"), with DeepSpeed as with zerolap, and a
    # destroy_process_group racing the other rank's exit can hang: the work is done, leave.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
