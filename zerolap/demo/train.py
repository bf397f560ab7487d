"""The main job: a small GPT learns zerolap's own docs on a few local processes, and shows what
the run did: memory per rank against the ZeRO formula, bytes on the wire against theory, how much
communication hid behind compute, and a timeline of the last steps.

``run_demo`` runs on every rank (``zerolap demo`` launches it through torchrun's machinery).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

import zerolap
import zerolap.comm as dist
from zerolap.config import parse_config
from zerolap.demo.corpus import CharTokenizer, corpus_text
from zerolap.demo.gpt import GPT, GPTConfig
from zerolap.profiling.profiler import StepProfiler
from zerolap.tensor_parallel.mappings import KINDS as TP_KINDS
from zerolap.tensor_parallel.mappings import gather_last_dim, skipped_collectives

__all__ = ["DemoOptions", "run_demo"]

MODEL_SIZES = {
    "tiny": dict(seq_len=64, n_layer=4, n_head=4, d_model=128),
    "small": dict(seq_len=128, n_layer=6, n_head=6, d_model=192),
}
TIMELINE_STEPS = 3  # the timeline shows the last few steps; a minute of steps is unreadable
SKIPPED_ROUNDS = 5  # steps as trained and with TP all-reduces skipped, alternating, each


@dataclass(frozen=True)
class DemoOptions:
    stage: int = 2
    steps: int = 450  # about a minute on 2 CPU cores
    model_size: str = "tiny"
    micro_batch: int = 16
    config: str | None = None  # a ds_config JSON path; replaces the built-in config
    out_dir: str = "runs/demo"
    offload: str = "none"  # none, cpu or nvme: offload_optimizer (and offload_param at stage 3)
    tp: int = 1  # tensor-parallel size (tensor_parallel.autotp_size); not with config
    tp_overlap: str = "full"  # tensor_parallel.overlap when tp > 1


def _offload(options: DemoOptions) -> dict:
    """The offload blocks of the built-in config: swap files go to ``<out>/swap``."""
    if options.offload == "none" or options.stage == 0:
        return {}
    block: dict = {"device": options.offload}
    if options.offload == "nvme":
        swap = Path(options.out_dir) / "swap"
        swap.mkdir(parents=True, exist_ok=True)
        block["nvme_path"] = str(swap)
    blocks = {"offload_optimizer": dict(block, buffer_count=2), "sub_group_size": 50_000}
    if options.stage == 3:
        blocks["offload_param"] = dict(block, max_in_cpu=0)
    return blocks


def _ds_config(options: DemoOptions) -> dict | str:
    if options.config:
        return options.config
    return {
        "train_micro_batch_size_per_gpu": options.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 20, "warmup_type": "linear"},
        },
        "zero_optimization": {
            "stage": options.stage,
            "overlap_comm": True,
            "reduce_scatter": True,
            "reduce_bucket_size": 100_000,
            # Stage 3: LayerNorms stay whole, every Linear and embedding is sharded.
            "stage3_param_persistence_threshold": 10_000,
            **_offload(options),
        },
        "tensor_parallel": {"autotp_size": options.tp, "overlap": options.tp_overlap}
        if options.tp > 1
        else {},
    }


def _batch(data: torch.Tensor, seq_len: int, size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(data) - seq_len - 1, (size,), generator=g)
    windows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def _sample(model: GPT, tokenizer: CharTokenizer, prompt: str, length: int, tensor_group) -> str:
    ids = tokenizer.encode(prompt).unsqueeze(0)
    g = torch.Generator().manual_seed(0)
    for _ in range(length):
        logits = model.logits(ids[:, -model.cfg.seq_len :])[:, -1]
        if tensor_group is not None:  # each rank of the tensor group holds a slice of the vocab
            logits = gather_last_dim(logits, tensor_group)
        logits = logits[:, : tokenizer.vocab_size]  # the rows padding the vocab never occur
        probs = torch.softmax(logits / 0.8, dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], dim=1)
    return tokenizer.decode(ids[0])


def _train(engine, data, options: DemoOptions, seq_len: int, profiler: StepProfiler) -> list:
    from tqdm import tqdm

    # Ranks of one tensor group train on the same batch; data-parallel ranks on their own.
    rank, world = engine.get_data_parallel_rank(), engine.dp_world_size
    tokens_per_step = options.micro_batch * seq_len * world
    losses = []
    bar = tqdm(
        range(options.steps),
        desc="zerolap demo",
        disable=dist.get_rank() != 0,
        ncols=100,
        mininterval=1.0,
    )
    began = time.perf_counter()
    with profiler:
        for step in bar:
            inputs, targets = _batch(data, seq_len, options.micro_batch, seed=step * world + rank)
            loss = engine(inputs, targets)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            rate = tokens_per_step * (step + 1) / (time.perf_counter() - began)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}")
    return losses


def _skipped_step_s(engine, data, options: DemoOptions, seq_len: int) -> tuple[float, float]:
    """Median step time of a few steps as trained, and of as many with the tensor-parallel
    all-reduces skipped (the step if that communication were free), alternating. Run last: the
    skipped steps' updates are wrong, and nothing uses the model after them."""
    rank, world = engine.get_data_parallel_rank(), engine.dp_world_size
    times: dict[bool, list[float]] = {False: [], True: []}
    for index in range(2 * SKIPPED_ROUNDS):
        skip = index % 2 == 1
        inputs, targets = _batch(data, seq_len, options.micro_batch, seed=index * world + rank)
        dist.barrier()
        began = time.perf_counter()
        with skipped_collectives() if skip else contextlib.nullcontext():
            engine.backward(engine(inputs, targets))
        engine.step()
        times[skip].append(time.perf_counter() - began)
    return statistics.median(times[False]), statistics.median(times[True])


def _report(engine, profiler: StepProfiler, losses: list, out: Path, text: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    data_world, tensor = engine.dp_world_size, engine.mp_world_size
    memory: list = [None] * world
    torch.distributed.all_gather_object(memory, engine.memory_breakdown().as_dict())
    comms = dist.log_summary() if rank == 0 else dist.COMMS_LOGGER.aggregate()
    numel = memory[0]["numel"]
    steps = len(losses)
    # ZeRO's traffic (over the data-parallel group) against its theory; TP's is reported apart.
    zero_records = [r for r in dist.COMMS_LOGGER.records if r.name not in TP_KINDS]
    wire = sum(r.wire_bytes for r in zero_records) / max(steps, 1)
    passes = 3 if engine.zero_optimization_stage() == 3 else 2  # stage 3 gathers twice
    theory = passes * numel * (data_world - 1) / data_world * 4
    overlap = profiler.summary()
    last = range(max(0, steps - TIMELINE_STEPS), steps)
    eta = overlap.get("eta", float("nan"))
    layout = f"TP {tensor} x DP {data_world}" if tensor > 1 else f"{world} ranks"
    paths = profiler.export(
        out,
        steps=last,
        title=f"zerolap demo: ZeRO-{engine.zero_optimization_stage()}, "
        f"{layout}, last {len(last)} steps, eta = {eta:.2f}",
    )
    summary = {
        "losses": losses,
        "memory": memory,
        "wire_bytes_per_step": wire,
        "wire_theory_bytes": theory,
        "overlap": overlap,
        "comms": comms,
        "sample": text,
        "tensor_parallel": tensor,
    }
    if rank == 0:
        _print_report(summary, paths, engine.zero_optimization_stage(), data_world, layout)
    return summary


def _print_report(summary: dict, paths, stage: int, world: int, layout: str) -> None:
    losses = summary["losses"]
    print(
        f"\nloss {losses[0]:.3f} -> {sum(losses[-10:]) / len(losses[-10:]):.3f} "
        f"(mean of the last 10 steps)"
    )
    print(f"\nsample after training:\n{summary['sample']}\n")
    print(f"model-state memory per rank (ZeRO-{stage}, {layout}, fp32 AdamW):")
    for m in summary["memory"]:
        print(
            f"  rank {m['rank']}: {m['total_bytes'] / 2**20:7.2f} MiB   expected "
            f"{m['expected_bytes'] / 2**20:7.2f} MiB   ZeRO paper (with fp32 master) "
            f"{m['zero_formula_bytes'] / 2**20:7.2f} MiB   + reusable buffers "
            f"{(m['bucket_buffer_bytes'] + m['param_buffer_bytes']) / 2**20:.2f} MiB"
        )
        if m["swapped_bytes"]:
            print(
                f"          swapped to disk {m['swapped_bytes'] / 2**20:7.2f} MiB (not resident), "
                f"through swap buffers of {m['swap_buffer_bytes'] / 2**20:.2f} MiB"
            )
        if m["host_bytes"]:
            print(
                f"          offloaded to host memory {m['host_bytes'] / 2**20:7.2f} MiB "
                "(master, optimizer state, gradient copies; not on the device)"
            )
    if world > 1:
        ratio = summary["wire_bytes_per_step"] / summary["wire_theory_bytes"]
        print(
            f"\nbytes sent per step per rank: {summary['wire_bytes_per_step'] / 2**20:.2f} MiB = "
            f"{ratio:.3f} x the theory {3 if stage == 3 else 2}*Psi*(N-1)/N*4 B"
        )
    o = summary["overlap"]
    print(
        f"\noverlap over {o['steps']} steps (per step, mean): compute {o['compute_s'] * 1e3:.1f}"
        f" ms, comm {o['comm_s'] * 1e3:.1f} ms, exposed comm {o['exposed_comm_s'] * 1e3:.1f} ms"
        f", eta = hidden/total comm = {o['eta']:.2f}"
    )
    print(
        f"step {o['step_s'] * 1e3:.1f} ms vs ideal max(compute, comm) {o['ideal_s'] * 1e3:.1f}"
        f" ms and serial compute + comm {o['serial_s'] * 1e3:.1f} ms"
    )
    if summary["tensor_parallel"] > 1:
        print(
            f"\ntensor parallelism ({summary['tensor_parallel']} ranks per tensor group), per step:"
        )
        print("  all-reduces   MiB   T_comm ms  exposed ms  eta_TP")
        for kind in ("tp_forward", "tp_backward"):
            if f"{kind}_comm_s" in o:
                print(
                    f"  {kind.removeprefix('tp_'):<10} {o[f'{kind}_bytes'] / 2**20:6.2f}  "
                    f"{o[f'{kind}_comm_s'] * 1e3:9.1f}  {o[f'{kind}_exposed_s'] * 1e3:10.1f}  "
                    f"{o[f'{kind}_eta']:6.2f}"
                )
    if paths:
        print(f"\ntimeline: {paths[1]}\ntrace (chrome://tracing, ui.perfetto.dev): {paths[0]}")


def run_demo(options: DemoOptions) -> dict:
    torch.set_num_threads(1)
    dist.init_distributed(verbose=False)
    text = corpus_text()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    shape = MODEL_SIZES[options.model_size]
    # Tensor parallelism splits the vocabulary: pad it to a multiple of the tensor size.
    tensor = _tensor_size(options)
    vocab = -(-tokenizer.vocab_size // tensor) * tensor
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, **shape))
    engine, *_ = zerolap.initialize(model=model, config=_ds_config(options))
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        print(
            f"zerolap demo: {params / 1e6:.2f}M-parameter GPT on {len(text):,} characters of "
            f"zerolap's docs, ZeRO-{engine.zero_optimization_stage()}, "
            f"{dist.get_world_size()} ranks, {options.steps} steps",
            flush=True,
        )
    profiler = StepProfiler(engine, blocks=model.blocks)
    losses = _train(engine, data, options, shape["seq_len"], profiler)
    engine.eval()
    tensor_group = engine.mpu.get_tensor_model_parallel_group() if tensor > 1 else None
    if engine.zero_optimization_stage() == 3 or tensor_group is not None:
        # Every rank takes part: in stage 3's gathers, in tensor parallelism's all-reduces.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # generation leaves the trace
            sample = _sample(model, tokenizer, "ZeRO ", 160, tensor_group)
    else:
        sample = _sample(model, tokenizer, "ZeRO ", 160, None) if dist.get_rank() == 0 else ""
    out = Path(options.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = _report(engine, profiler, losses, out, sample)
    if tensor_group is not None:
        engine.train()
        trained, skipped = _skipped_step_s(engine, data, options, shape["seq_len"])
        summary["tp_step_s"], summary["tp_skipped_step_s"] = trained, skipped
        if dist.get_rank() == 0:
            print(
                f"step {trained * 1e3:.1f} ms against {skipped * 1e3:.1f} ms for the same step "
                f"with its tensor-parallel all-reduces skipped ({trained / skipped:.2f}x; "
                f"medians of {SKIPPED_ROUNDS} each, alternating)"
            )
    if dist.get_rank() == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    dist.barrier()
    return summary


def _tensor_size(options: DemoOptions) -> int:
    """The tensor-parallel size the run will have: ``--tp``, or the ``--config``'s."""
    if not options.config:
        return options.tp
    return parse_config(options.config).tensor_parallel.size
