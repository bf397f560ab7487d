"""A zerolap run resumed by real DeepSpeed 0.19.8 through a universal checkpoint, at other
data-parallel sizes and ZeRO stages than it was saved at.

Run from the repo root: ``python benchmarks/universal_deepspeed_diff.py --deepspeed-python
/tmp/dsenv/bin/python`` (``benchmarks/deepspeed_diff.py --make-env`` makes that environment).

zerolap (``--trainer``) trains the model of ``tests/checkpoint/deepspeed_0_19_8`` (tied
embedding, frozen parameter, odd sizes) for 3 steps on 2 ranks at ZeRO stage ``--stage``, saves,
and takes a 4th step: its loss and parameters are the reference. zerolap's ``ds_to_universal``
(``--converter``) converts the checkpoint; then DeepSpeed loads the converted folder
(``checkpoint.load_universal``) on 1 and 2 ranks at stages 1, 2 and 3 and takes the 4th step on
the same global batch. Printed per resume: the 4th step's loss and largest parameter
difference from the reference (DeepSpeed's Adam and torch's differ in the last bits of fp32),
or DeepSpeed's error when it refuses. Variants: ``--client-optimizer`` (both sides step a torch
AdamW of the client's), ``--two-groups`` (weight decay on matrices only; ``--equal-groups``:
two groups with the same), ``--bf16``, and ``--trainer deepspeed`` / ``--converter deepspeed``
(DeepSpeed's own run, or its own converter).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.deepspeed_diff import launch_ranks

RESUMES = [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2)]  # (ZeRO stage, ranks)


def _step(engine, number: int, saved_world: int):
    """Step ``number`` on the micro-batches the saved run's ranks would take, split over the
    ranks there are now; the loss averaged over ranks."""
    import torch

    from tests.checkpoint.deepspeed_0_19_8.model import batch

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    per_rank = saved_world // world
    mine = [batch(number, r) for r in range(rank * per_rank, (rank + 1) * per_rank)]
    loss = engine(torch.cat([x for x, _ in mine]), torch.cat([y for _, y in mine]))
    engine.backward(loss)
    engine.step()
    mean = loss.detach().float().reshape(1)
    torch.distributed.all_reduce(mean)
    return mean.item() / world


def worker(library: str, root: Path, stage: int, saved_world: int, options: str) -> None:
    import torch

    from tests.checkpoint.deepspeed_0_19_8.model import (
        LR,
        MICRO,
        STEPS,
        WEIGHT_DECAY,
        build_model,
        ds_config,
        param_groups,
    )

    if library == "zerolap":
        import zerolap as deepspeed
    else:
        import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = build_model()
    config = ds_config(stage, world, "bf16" in options)
    config["train_micro_batch_size_per_gpu"] = MICRO * saved_world // world
    config["train_batch_size"] = MICRO * saved_world
    trains = "train" in options  # else it resumes the converted checkpoint
    config["checkpoint"] = {"load_universal": not trains}
    groups = param_groups(model, "groups" in options)
    groups = groups if "groups" in options else [p for p in groups if p.requires_grad]
    if "equal" in options:  # two groups alike: several sub-groups, one set of hyperparameters
        groups[1]["weight_decay"] = WEIGHT_DECAY
    optimizer = None
    if "client" in options:  # the client's torch AdamW, as the Trainer passes by default
        del config["optimizer"]
        optimizer = torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=groups, optimizer=optimizer, config=config
    )
    if trains:
        for number in range(1, STEPS + 1):
            _step(engine, number, saved_world)
        engine.save_checkpoint(str(root / "ckpt"))
    else:
        engine.load_checkpoint(str(root / "ckpt"))
    loss = _step(engine, STEPS + 1, saved_world)
    params = {
        n: safe_get_full_fp32_param(p).detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    if rank == 0:
        torch.save({"loss": loss, "params": params}, root / f"{library}_s{stage}_w{world}.pt")
    # An orderly exit: a DeepSpeed rank left to tear gloo down by itself at exit sometimes aborts.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed-python", required=True)
    parser.add_argument("--stage", type=int, default=2, help="the ZeRO stage of the first run")
    parser.add_argument(
        "--trainer", choices=["zerolap", "deepspeed"], default="zerolap", help="who trains first"
    )
    parser.add_argument(
        "--converter", choices=["zerolap", "deepspeed"], default="zerolap",
        help="whose ds_to_universal converts",
    )  # fmt: skip
    parser.add_argument(
        "--client-optimizer", action="store_true", help="both sides step a client torch AdamW"
    )
    parser.add_argument(
        "--two-groups", action="store_true", help="weight decay on matrices only (2 groups)"
    )
    parser.add_argument(
        "--equal-groups", action="store_true", help="two groups with the same weight decay"
    )
    parser.add_argument("--bf16", action="store_true", help="both sides train in bf16")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        library, root, stage, saved_world, options = args.worker
        worker(library, Path(root), int(stage), int(saved_world), options)
        return 0
    options = ",".join(
        [
            "plain",
            *(["client"] if args.client_optimizer else []),
            *(["groups"] if args.two_groups or args.equal_groups else []),
            *(["equal"] if args.equal_groups else []),
            *(["bf16"] if args.bf16 else []),
        ]
    )
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        pythons = {"zerolap": sys.executable, "deepspeed": args.deepspeed_python}

        def launch(library: str, stage: int, ranks: int, extra: str = "") -> None:
            launch_ranks(
                pythons[library], Path(__file__), ["--deepspeed-python", "-", "--worker",
                                                   library, tmp, str(stage), "2", options + extra],
                cwd=tmp, label=f"{library} stage {stage} on {ranks}", ranks=ranks,
            )  # fmt: skip

        launch(args.trainer, args.stage, 2, ",train")
        want = torch.load(root / f"{args.trainer}_s{args.stage}_w2.pt")
        tag = root / "ckpt" / "global_step3"
        if args.converter == "zerolap":
            from zerolap.checkpoint.universal import write_universal

            write_universal(tag, tag.with_name(f"{tag.name}_universal"))
        else:
            subprocess.run(
                [args.deepspeed_python, "-m", "deepspeed.checkpoint.ds_to_universal",
                 "--inject_missing_state", "--input_folder", str(tag), "--output_folder",
                 f"{tag}_universal"],
                check=True, capture_output=True, cwd=tmp,
            )  # fmt: skip
        print(f"{args.trainer} trained at stage {args.stage} on 2 ranks, {args.converter} "
              f"converted; the 4th-step loss {want['loss']:.6f}")  # fmt: skip
        print("| DeepSpeed resumes at | 4th-step loss | loss gap | largest parameter gap |")
        print("|---|---|---|---|")
        for stage, ranks in RESUMES:
            where = f"| stage {stage}, {ranks} rank{'s' * (ranks > 1)} |"
            try:
                launch("deepspeed", stage, ranks)
            except SystemExit as failed:  # DeepSpeed refused: its last error line
                lines = [line.split("]: ", 1)[-1] for line in str(failed).splitlines()]
                errors = [line for line in lines if re.match(r"\w+(Error|Exception)\b", line)]
                print(f"{where} fails: {(errors or ['?'])[-1]} | | |")
                continue
            got = torch.load(root / f"deepspeed_s{stage}_w{ranks}.pt")
            gap = max((got["params"][n] - v).abs().max().item() for n, v in want["params"].items())
            print(f"{where} {got['loss']:.6f} | {abs(got['loss'] - want['loss']):.1e} | "
                  f"{gap:.1e} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
