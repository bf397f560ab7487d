"""TRL's DeepSpeed helpers driven as its trainers drive them, launched by torchrun from
``test_trl.py``: a frozen reference model wrapped by ``trl.models.utils.prepare_deepspeed`` (an
engine without optimizer), and a policy that generates inside ``unwrap_model_for_generation``
(under ZeRO-3 every parameter gathered and the fetch hooks taken off and put back) and then
trains on what it generated. Without ``--stage`` the same loop runs on plain DDP. Rank 0
writes the losses (mean over ranks), the reference model's mean |logit| and the generations."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin
from transformers import AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=-1, help="-1: no DeepSpeed")
    parser.add_argument("--model", required=True, help="a save_pretrained folder")
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    PartialState(cpu=True, backend="gloo")
    plugin = None
    if args.stage >= 0:
        plugin = DeepSpeedPlugin(zero_stage=args.stage, gradient_clipping=1.0)
    accelerator = Accelerator(deepspeed_plugin=plugin)
    from trl.models.utils import prepare_deepspeed, unwrap_model_for_generation

    # from_pretrained: under stage 3 that is zero.Init and the ZeRO-3 loading path, and the
    # same weights as the plain run (from_config under zero.Init initialises in another order).
    policy = AutoModelForCausalLM.from_pretrained(args.model)
    reference = AutoModelForCausalLM.from_pretrained(args.model).requires_grad_(False).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    tokens = torch.randint(0, 128, (16, 6), generator=torch.Generator().manual_seed(1))
    prompts = torch.utils.data.DataLoader(tokens, batch_size=2)
    policy, optimizer, prompts = accelerator.prepare(policy, optimizer, prompts)
    if plugin is not None:
        reference = prepare_deepspeed(reference, accelerator)
    result = {"losses": [], "reference": [], "generated": []}
    for ids in prompts:
        with torch.no_grad():
            result["reference"].append(reference(input_ids=ids).logits.abs().mean().item())
        with unwrap_model_for_generation(policy, accelerator) as unwrapped:
            generated = unwrapped.generate(ids[:, :4], max_new_tokens=4, do_sample=False)
        loss = policy(input_ids=generated, labels=generated).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(policy.parameters(), 1.0)  # DeepSpeed: the config clips
        optimizer.step()
        optimizer.zero_grad()
        result["losses"].append(accelerator.gather(loss.detach()).mean().item())
        result["generated"].append(accelerator.gather(generated).tolist())
    if accelerator.is_main_process:
        with open(args.result, "w") as f:
            json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # see hf_trainer.py: gloo's interpreter-exit race


if __name__ == "__main__":
    main()
