"""The Hugging Face Trainer, unchanged, on zerolap through the ``deepspeed`` shim: 2 processes,
a ds_config of "auto" values, gradient accumulation, evaluation, checkpoints and resume.

Every run is compared with the same Trainer run without DeepSpeed (plain DDP on the same ranks,
data and initial weights): the logged training and evaluation losses must agree within 1e-5
(fp32). The tiny GPT-2 comes from ``from_pretrained`` (under stage 3 that is ``zero.Init`` and
the Trainer's ZeRO-3 loading path); the tiny Llama from ``from_config`` under stage 3, whose
parameters must be sharded as they are built. Each run is a separate launch: Accelerate allows
one DeepSpeed-backed accelerator per process.
"""

from __future__ import annotations

import functools
import shutil

import pytest
import torch

from tests.clients.launch import launch
from zerolap.checkpoint.universal import write_universal

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name)``: the result of one named launch, run once and remembered."""
    root = tmp_path_factory.mktemp("trainer")
    (root / "swap").mkdir()  # offload_optimizer's nvme_path
    gpt2 = root / "gpt2"
    torch.manual_seed(0)
    from tests.clients.hf_trainer import tiny_config

    model = transformers.AutoModelForCausalLM.from_config(tiny_config("gpt2"))
    model.save_pretrained(gpt2, safe_serialization=True)
    # Tensor parallelism draws dropout masks per slice, a dense model per whole tensor: the TP
    # comparison runs without dropout.
    undropped = root / "gpt2-no-dropout"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("gpt2", dropout=0.0))
    model.save_pretrained(undropped, safe_serialization=True)
    undropped_model = ["--model", str(undropped)]
    llama_init = root / "llama-init"  # written by the from_config run, read by its reference

    gpt2_model, llama_model = ["--model", str(gpt2)], ["--model", str(llama_init)]
    checkpoint = {
        name: str(root / name / "checkpoint-2") for name in ("gpt2 stage 3", "llama stage 3")
    }
    plans = {
        "gpt2 plain": gpt2_model,
        "gpt2 stage 2": [*gpt2_model, "--stage", "2", "--ds-optimizer"],
        "gpt2 stage 3": [*gpt2_model, "--stage", "3"],
        "gpt2 lora plain": [*gpt2_model, "--lora"],
        "gpt2 lora stage 3, gradient checkpointing": [
            *gpt2_model, "--lora", "--stage", "3", "--gradient-checkpointing"
        ],
        "gpt2 stage 3 offload": [*gpt2_model, "--stage", "3", "--offload-apart"],
        "gpt2 stage 2 nvme": [*gpt2_model, "--stage", "2", "--nvme", str(root / "swap")],
        "gpt2 stage 3 resumed": [
            *gpt2_model, "--stage", "3", "--resume", checkpoint["gpt2 stage 3"]
        ],
        "llama stage 3": [
            "--arch", "llama", "--stage", "3", "--ds-optimizer", "--init-out", str(llama_init)
        ],
        "llama plain": llama_model,
        "llama stage 2 resumed": [
            *llama_model, "--stage", "2", "--ds-optimizer", "--resume", checkpoint["llama stage 3"]
        ],
        # A copy of that checkpoint holding only its universal form (``ds_to_universal``).
        "llama stage 1 resumed from universal": [
            *llama_model, "--stage", "1", "--ds-optimizer", "--universal",
            "--resume", str(root / "universal" / "checkpoint-2"),
        ],
        "gpt2 no dropout plain": undropped_model,
        "gpt2 tp 2 x dp 2": [
            *undropped_model, "--stage", "1", "--ds-optimizer", "--tp", "2",
            "--tp-overlap", "full",
        ],
        "gpt2 tp 2 x dp 2, trainer's optimizer": [
            *undropped_model, "--stage", "2", "--tp", "2", "--tp-overlap", "backward",
        ],
        # Sequence parallelism over both ranks: accumulating the two ranks' batches in turn
        # is one step of plain DDP over them.
        "llama plain, no accumulation": [*llama_model, "--gas", "1"],
        "llama sp 2, stage 2": [*llama_model, "--stage", "2", "--sp", "2", "--gas", "2"],
        "llama sp 2, stage 3": [
            *llama_model, "--stage", "3", "--sp", "2", "--gas", "2", "--ds-optimizer"
        ],
    }  # fmt: skip
    nproc = {"gpt2 tp 2 x dp 2": 4, "gpt2 tp 2 x dp 2, trainer's optimizer": 4}

    needs = {  # runs that read what another run wrote
        "gpt2 stage 3 resumed": "gpt2 stage 3",
        "llama plain": "llama stage 3",
        "llama stage 2 resumed": "llama stage 3",
        "llama stage 1 resumed from universal": "llama stage 3",
        "llama plain, no accumulation": "llama stage 3",
        "llama sp 2, stage 2": "llama stage 3",
        "llama sp 2, stage 3": "llama stage 3",
    }

    @functools.cache
    def run(name: str) -> dict:
        if name in needs:
            run(needs[name])
        if name == "llama stage 1 resumed from universal":
            copy = shutil.copytree(checkpoint["llama stage 3"], root / "universal" / "checkpoint-2")
            write_universal(copy / "global_step2", copy / "global_step2_universal")
            shutil.rmtree(copy / "global_step2")
            (copy / "latest").unlink()
        out = root / name
        return launch(
            "hf_trainer.py",
            root / f"{name}.json",
            *plans[name],
            "--out",
            str(out),
            nproc=nproc.get(name, 2),
        )

    return run


def _close(got: dict, want: dict, steps) -> None:
    for step in steps:
        assert abs(got[str(step)] - want[str(step)]) < TOLERANCE, (step, got, want)


def test_stage_2_trains_as_plain_ddp(runs):
    zero2, plain = runs("gpt2 stage 2"), runs("gpt2 plain")
    assert zero2["engine"] == "zerolap.runtime.engine"  # the shim's engine, not DeepSpeed's
    _close(zero2["losses"], plain["losses"], range(1, 5))
    _close(zero2["evals"], plain["evals"], (2, 4))


def test_stage_3_from_pretrained_trains_as_plain_ddp(runs):
    zero3, plain = runs("gpt2 stage 3"), runs("gpt2 plain")
    assert zero3["sharded_at_build"]  # from_pretrained ran under zero.Init
    _close(zero3["losses"], plain["losses"], range(1, 5))
    _close(zero3["evals"], plain["evals"], (2, 4))


def test_peft_lora_with_gradient_checkpointing_under_stage_3_trains_as_plain_ddp(runs):
    """PEFT's LoRA adapters on a frozen GPT-2 under stage 3, with the Trainer's gradient
    checkpointing (each block's forward run again in backward, its sharded weights gathered
    again for it): the same losses, gradient norms and saved adapter as plain DDP training the
    same adapters without checkpointing."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    lora, plain = runs("gpt2 lora stage 3, gradient checkpointing"), runs("gpt2 lora plain")
    assert lora["checkpointing"] and not plain["checkpointing"]
    _close(lora["losses"], plain["losses"], range(1, 5))
    _close(lora["grad_norms"], plain["grad_norms"], range(1, 5))
    _close(lora["evals"], plain["evals"], (2, 4))
    got, want = load_file(lora["adapter"]), load_file(plain["adapter"])
    assert sorted(got) == sorted(want) and len(want) == 12  # A and B of 3 projections x 2 blocks
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=TOLERANCE)


def test_stage_3_with_the_documented_offload_blocks_trains_as_plain_ddp(runs):
    """The Trainer documentation's ZeRO-3 config with ``offload_optimizer`` and
    ``offload_param`` on ``cpu``, run as from an accelerator (master, Adam state, gradient and
    parameter shards in host memory apart from the training device), with the Trainer's own
    optimizer."""
    offloaded, plain = runs("gpt2 stage 3 offload"), runs("gpt2 plain")
    assert offloaded["host_bytes"] > 0  # the state really moved
    _close(offloaded["losses"], plain["losses"], range(1, 5))
    _close(offloaded["evals"], plain["evals"], (2, 4))


def test_stage_2_with_the_optimizer_state_on_disk_trains_as_plain_ddp(runs):
    """``offload_optimizer`` on nvme with the Trainer's own optimizer and schedule: the swapped
    sub-groups step behind ``step()`` while the Trainer steps its scheduler, logs, evaluates
    and saves checkpoints."""
    swapped, plain = runs("gpt2 stage 2 nvme"), runs("gpt2 plain")
    assert swapped["swapped_bytes"] > 0 and swapped["defer_step"]
    _close(swapped["losses"], plain["losses"], range(1, 5))
    _close(swapped["evals"], plain["evals"], (2, 4))


def test_stage_3_resume_continues_the_run(runs):
    resumed, full = runs("gpt2 stage 3 resumed"), runs("gpt2 stage 3")
    # Steps 1-2 come back from the checkpoint's trainer state; 3-4 are trained again and
    # differ from a fresh start unless weights, optimizer state and schedule were restored.
    _close(resumed["losses"], full["losses"], (3, 4))
    _close(resumed["evals"], full["evals"], (4,))


def test_from_config_under_stage_3_shards_as_it_builds_and_trains_as_plain_ddp(runs):
    zero3 = runs("llama stage 3")
    plain = runs("llama plain")  # from the weights zero.Init built
    assert zero3["sharded_at_build"]
    _close(zero3["losses"], plain["losses"], range(1, 5))
    _close(zero3["evals"], plain["evals"], (2, 4))


def test_a_stage_3_checkpoint_resumes_at_stage_2(runs):
    resumed, full = runs("llama stage 2 resumed"), runs("llama stage 3")
    _close(resumed["losses"], full["losses"], (3, 4))


def test_a_universal_checkpoint_resumes_through_the_trainer(runs):
    resumed, full = runs("llama stage 1 resumed from universal"), runs("llama stage 3")
    _close(resumed["losses"], full["losses"], (3, 4))


@pytest.mark.parametrize("name", ["gpt2 tp 2 x dp 2", "gpt2 tp 2 x dp 2, trainer's optimizer"])
def test_tensor_parallel_through_tp_model_init_trains_as_plain_ddp(runs, name):
    """``tensor_parallel.autotp_size: 2`` on 4 processes: the Trainer calls
    ``deepspeed.tp_model_init``, builds its optimizer (or the ds_config's parameter list) over
    the dense model, then calls ``initialize``, which splits the model and points both at the
    split parameters; Accelerate feeds each tensor group one batch. ZeRO-1 with the blocks'
    micro-batches in two lanes (overlap full), and ZeRO-2 with the Trainer's own AdamW and the
    backward overlap, each train as plain DDP on 2 processes does."""
    tp, plain = runs(name), runs("gpt2 no dropout plain")
    assert (tp["tensor_parallel"], tp["data_parallel"]) == (2, 2)
    _close(tp["losses"], plain["losses"], range(1, 5))
    _close(tp["evals"], plain["evals"], (2, 4))


@pytest.mark.parametrize("name", ["llama sp 2, stage 2", "llama sp 2, stage 3"])
def test_sequence_parallel_through_accelerate_trains_as_plain_ddp(runs, name):
    """``ParallelismConfig(sp_backend="deepspeed", sp_size=2)``: Accelerate registers Ulysses
    attention, wraps the loader in ``UlyssesSPDataLoaderAdapter`` and passes its mpu to
    ``initialize``; the Trainer all-gathers the pieces' losses. Each step accumulates the two
    ranks' batches, every sequence cut over both ranks, and trains as one step of plain DDP
    over the same batches: the same losses and the same gradient norms (DeepSpeed 0.19.8's
    stage 2 reports, and applies, twice the norm)."""
    sp, plain = runs(name), runs("llama plain, no accumulation")
    assert (sp["sequence_parallel"], sp["data_parallel"]) == (2, 1)
    _close(sp["losses"], plain["losses"], range(1, 5))
    _close(sp["grad_norms"], plain["grad_norms"], range(1, 5))
    _close(sp["evals"], plain["evals"], (2, 4))
