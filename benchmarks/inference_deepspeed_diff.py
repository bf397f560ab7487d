"""DeepSpeed 0.19.8's ``init_inference`` against zerolap's: the same Llama split over 2 ranks
(DeepSpeed's AutoTP, zerolap's tensor-parallel plan), its logits and greedy tokens compared with
the unsplit model's, and the time per generated token.

Run from the repo root: ``python benchmarks/inference_deepspeed_diff.py --deepspeed-python
/tmp/dsenv/bin/python`` (``benchmarks/deepspeed_diff.py --make-env`` makes that environment).
Each round launches both libraries in turn (2 ranks, gloo, one thread each); each launch builds
the model from one seed, keeps an unsplit copy, calls ``init_inference(model, mp_size=2,
dtype=..., replace_with_kernel_inject=False)`` and times ``generate`` (greedy, ``--new``
tokens after a prompt of ``--prompt``) on the split model and on the copy. Printed: the largest
logit difference from the unsplit model, whether the tokens equal its tokens, and the median ms
per token over the rounds, with the unsplit model's (one rank per core, both at once).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.deepspeed_diff import launch_ranks


def worker(library: str, out: str, args: argparse.Namespace) -> None:
    import copy
    import time

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if library == "zerolap":
        import zerolap as deepspeed
    else:
        import deepspeed
        import deepspeed.comm.torch  # the package's ``torch`` attribute is torch: use sys.modules

        # DeepSpeed's shared-memory all-reduce for CPU inference crashes on this VM (SIGSEGV
        # at its first use; the host has AVX2 and no AVX-512): its gloo fallback, as zerolap's.
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

    deepspeed.init_distributed(dist_backend="gloo")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    config = AutoConfig.for_model(
        "llama", num_hidden_layers=args.layers, hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=8192, max_position_embeddings=1024, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval().to(dtype)
    dense = copy.deepcopy(model)
    ids = torch.randint(1, 8192, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    engine = deepspeed.init_inference(
        model, mp_size=2, dtype=dtype, replace_with_kernel_inject=False
    )

    def per_token(run) -> tuple[float, torch.Tensor]:
        run()  # warm-up
        times = []
        for _ in range(3):
            began = time.perf_counter()
            tokens = run()
            times.append((time.perf_counter() - began) / args.new * 1e3)
        return statistics.median(times), tokens

    def generate(module):
        return lambda: module.generate(
            input_ids=ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False
        )

    with torch.no_grad():
        gap = (engine(ids).logits.float() - dense(ids).logits.float()).abs().max().item()
        split_ms, split_tokens = per_token(generate(engine))
        dense_ms, dense_tokens = per_token(generate(dense))
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "gap": gap,
                    "same_tokens": torch.equal(split_tokens, dense_tokens),
                    "split_ms": split_ms,
                    "dense_ms": dense_ms,
                }
            )
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed-python", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # library, output file
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args)
        return 0
    results: dict[str, list[dict]] = {"deepspeed": [], "zerolap": []}
    sizes = [
        f"--{key}={getattr(args, key)}" for key in ("hidden", "layers", "prompt", "new", "dtype")
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = ("deepspeed", "zerolap") if round_ % 2 == 0 else ("zerolap", "deepspeed")
            for library in order:
                python = args.deepspeed_python if library == "deepspeed" else sys.executable
                out = Path(tmp) / f"{library}-{round_}.json"
                launch_ranks(
                    python,
                    Path(__file__).resolve(),
                    ["--deepspeed-python", python, *sizes, "--worker", library, str(out)],
                    cwd=tmp,
                    label=library,
                )
                results[library].append(json.loads(out.read_text()))
    print(
        f"Llama, hidden {args.hidden}, {args.layers} layers, {args.dtype}, 2 ranks (gloo, one "
        f"thread each); {args.new} greedy tokens after {args.prompt}; medians of "
        f"{args.rounds} rounds\n"
    )
    print(
        "| library | largest logit difference from unsplit | same tokens as unsplit | "
        "ms / token, split | ms / token, unsplit | split / unsplit |"
    )
    print("|---|---|---|---|---|---|")
    for library, runs in results.items():
        split = statistics.median(r["split_ms"] for r in runs)
        dense = statistics.median(r["dense_ms"] for r in runs)
        print(
            f"| {library} | {max(r['gap'] for r in runs):.1e} | "
            f"{all(r['same_tokens'] for r in runs)} | {split:.1f} | {dense:.1f} | "
            f"{split / dense:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
