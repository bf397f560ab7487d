"""A DeepSpeed-style training script, run unchanged by zerolap.

    zerolap run -n 2 examples/train_gpt.py --deepspeed_config examples/ds_config_zero2.json

Only the import differs from a DeepSpeed script: ``import zerolap as deepspeed``.
"""

from __future__ import annotations

import argparse

import torch

import zerolap as deepspeed
from zerolap.demo.gpt import GPT, GPTConfig, synthetic_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save_dir", default=None, help="save a checkpoint here at the end")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.set_num_threads(1)
    deepspeed.init_distributed()
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=128)
    torch.manual_seed(0)
    engine, _, _, _ = deepspeed.initialize(args=args, model=GPT(cfg))
    rank = deepspeed.comm.get_rank()
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(args.steps):
        inputs, targets = synthetic_batch(cfg, micro, seed=step * 100 + rank)
        loss = engine(inputs, targets)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if rank == 0 and boundary:
            print(f"step {engine.global_steps} loss {loss.item():.4f} lr {engine.get_lr()[0]:.2e}")
    if args.save_dir:
        engine.save_checkpoint(args.save_dir)
    if rank == 0:
        print(f"done: {engine.global_steps} optimizer steps, {engine.global_samples} samples")


if __name__ == "__main__":
    main()
