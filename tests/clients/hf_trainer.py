"""A Hugging Face Trainer run, launched by torchrun from ``test_hf_trainer.py``: a tiny causal
LM trained with (or without) a ds_config full of "auto" values, as the Trainer documentation
writes them. Rank 0 writes the logged losses (and what the test asks about the model) to
``--result`` as JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

VOCAB = 128


def ds_config(
    stage: int,
    *,
    optimizer: bool,
    tp: int = 1,
    tp_overlap: str = "off",
    offload: bool = False,
    nvme: str | None = None,
    universal: bool = False,
) -> dict:
    config = {
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }
    if offload:  # the Trainer documentation's ZeRO-3 offload blocks
        for key in ("offload_optimizer", "offload_param"):
            config["zero_optimization"][key] = {"device": "cpu", "pin_memory": True}
    if nvme:  # the optimizer state on disk, its step behind step() (defer_step)
        config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
        config["zero_optimization"]["sub_group_size"] = 2000  # several sub-groups per bucket
        config["zero_optimization"]["reduce_bucket_size"] = 20000  # several buckets
    if universal:  # resume from the folder ds_to_universal wrote
        config["checkpoint"] = {"load_universal": True}
    if tp > 1:  # the Trainer calls deepspeed.tp_model_init, then initialize
        config["tensor_parallel"] = {"autotp_size": tp, "overlap": tp_overlap}
    if optimizer:  # else the Trainer hands its own torch optimizer to initialize()
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
    return config


def tiny_config(arch: str, dropout: float = 0.1):
    if arch == "gpt2":
        return AutoConfig.for_model(
            "gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
            bos_token_id=0, eos_token_id=0,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        )  # fmt: skip
    return AutoConfig.for_model(
        "llama", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int, positions: bool = False) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (count, 16), generator=generator)
        self.positions = positions  # sequence parallelism needs each token's place

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        item = {"input_ids": self.ids[i], "labels": self.ids[i]}
        if self.positions:
            item["position_ids"] = torch.arange(len(self.ids[i]))
        return item


def sequence_parallel(size: int) -> dict:
    """Accelerate's ParallelismConfig for DeepSpeed's Ulysses sequence parallelism."""
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(
        sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"
    )
    return {
        "parallelism_config": ParallelismConfig(
            sp_backend="deepspeed", sp_size=size, sp_handler=handler
        )
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=-1, help="-1: no DeepSpeed")
    parser.add_argument("--arch", default="gpt2")
    parser.add_argument("--model", help="a save_pretrained folder; else from_config")
    parser.add_argument("--ds-optimizer", action="store_true")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel.autotp_size")
    parser.add_argument("--tp-overlap", default="off", help="tensor_parallel.overlap")
    parser.add_argument(
        "--offload-apart",
        action="store_true",
        help="offload to host memory as from an accelerator (the CPU stands in for one)",
    )
    parser.add_argument("--nvme", help="offload_optimizer to swap files in this folder")
    parser.add_argument("--sp", type=int, default=1, help="sequence parallelism (Ulysses)")
    parser.add_argument("--gas", type=int, default=2, help="gradient_accumulation_steps")
    parser.add_argument("--lora", action="store_true", help="train PEFT LoRA adapters only")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume")
    parser.add_argument("--universal", action="store_true", help="checkpoint.load_universal")
    parser.add_argument("--init-out", help="save the initial weights here (save_pretrained)")
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    training = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=args.gas,
        max_steps=4,
        learning_rate=1e-2,
        warmup_steps=1,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=2,
        save_steps=2,
        report_to=[],
        use_cpu=True,  # on a CPU-only host the Trainer counts the ranks only so
        dataloader_num_workers=0,
        seed=0,
        gradient_checkpointing=args.gradient_checkpointing,
        deepspeed=ds_config(
            args.stage,
            optimizer=args.ds_optimizer,
            tp=args.tp,
            tp_overlap=args.tp_overlap,
            offload=args.offload_apart,
            nvme=args.nvme,
            universal=args.universal,
        )
        if args.stage >= 0
        else None,
        **(sequence_parallel(args.sp) if args.sp > 1 else {}),
    )
    if args.stage >= 0:
        # Real DeepSpeed's zero.Init reads the world size from deepspeed.comm, which Accelerate
        # did not set up on a CPU-only host (it initialised torch.distributed itself): without
        # this, DeepSpeed fails its batch-size check at stage 3. For zerolap it changes nothing.
        import deepspeed

        deepspeed.init_distributed()
    if args.offload_apart:  # this host's memory stands apart from a pretend accelerator
        import zerolap.offload

        zerolap.offload.apart_from_host = lambda device: True
    torch.manual_seed(0)
    # Sequence parallelism wraps the attention kernel the model runs (sdpa here).
    attention = {"attn_implementation": "sdpa"} if args.sp > 1 else {}
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, **attention)
    else:
        model = AutoModelForCausalLM.from_config(tiny_config(args.arch), **attention)
    if args.lora:  # PEFT's adapters on the attention's projections; the base is frozen
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.0,
            init_lora_weights="gaussian",  # lora_B starts nonzero, so every weight moves
        )  # fmt: skip
        model = get_peft_model(model, lora)
    first = next(model.parameters())
    sharded_at_build = first.numel() == 0 and getattr(first, "ds_numel", 0) > 0
    if args.init_out:
        import zerolap

        params = list(model.parameters())
        with zerolap.zero.GatheredParameters(params):
            if torch.distributed.get_rank() == 0:
                model.save_pretrained(args.init_out, safe_serialization=True)
        torch.distributed.barrier()
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Tokens(64, 1, positions=args.sp > 1),
        eval_dataset=Tokens(8, 2, positions=args.sp > 1),
    )
    trainer.train(resume_from_checkpoint=args.resume)
    history = trainer.state.log_history
    result = {
        "losses": {h["step"]: h["loss"] for h in history if "loss" in h},
        "grad_norms": {h["step"]: h["grad_norm"] for h in history if "grad_norm" in h},
        "evals": {h["step"]: h["eval_loss"] for h in history if "eval_loss" in h},
        "sharded_at_build": sharded_at_build,
        "engine": type(trainer.model_wrapped).__module__,
        "tensor_parallel": getattr(trainer.model_wrapped, "mp_world_size", 1),
        "data_parallel": getattr(trainer.model_wrapped, "dp_world_size", None),
        "sequence_parallel": getattr(trainer.model_wrapped, "sequence_parallel_size", 1),
    }
    if args.lora:  # the adapter as PEFT writes it (under stage 3, gathered from the shards)
        trainer.save_model(os.path.join(args.out, "adapter"))
        result["adapter"] = os.path.join(args.out, "adapter", "adapter_model.safetensors")
        result["checkpointing"] = trainer.model.base_model.model.is_gradient_checkpointing
    if args.offload_apart:  # zerolap's engine (real DeepSpeed has no memory_breakdown)
        result["host_bytes"] = trainer.model_wrapped.memory_breakdown().host_bytes
    if args.nvme:
        result["swapped_bytes"] = trainer.model_wrapped.memory_breakdown().swapped_bytes
        result["defer_step"] = trainer.model_wrapped.optimizer.defer_step
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.result, "w") as f:
            json.dump(result, f)
    # Interpreter exit tears gloo's threads down in an order that sometimes aborts a rank
    # ("terminate called without an active exception"), with DeepSpeed as with zerolap, and a
    # destroy_process_group racing the other rank's exit can hang: the work is done, leave.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
