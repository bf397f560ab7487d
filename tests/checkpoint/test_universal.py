"""DeepSpeed's universal checkpoints (``ds_to_universal``'s output, in ``deepspeed_0_19_8/<case>/
ckpt/global_step3_universal``, converted by DeepSpeed 0.19.8 itself) resumed by zerolap: the
next step's loss and parameters must be DeepSpeed's own next step from the checkpoint before
conversion, at the saved stage and size and at others. Then zerolap's own converter: its files
equal DeepSpeed's converter's, and its output resumes and consolidates like its source (real
DeepSpeed resuming it is ``benchmarks/universal_deepspeed_diff.py``)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint.deepspeed_0_19_8.model import TinyNet
from tests.checkpoint.test_deepspeed_format import HERE, TIMEOUT, _check, _expected, resume_and_step
from tests.logs import captured_logs
from zerolap.checkpoint import CheckpointError, get_fp32_state_dict
from zerolap.checkpoint.deepspeed_format import load_file
from zerolap.checkpoint.universal import write_universal

TAG = "global_step3_universal"


@pytest.mark.parametrize(
    ("case", "stage", "world", "tolerance"),
    [
        ("s2_ws2", 2, 2, 1e-5),
        ("s2_ws2", 3, 1, 1e-5),
        ("s2_ws2_bf16", 2, 2, 2e-3),
        ("s3_ws2_2g", 3, 2, 1e-5),
        ("s3_ws2_2g", 1, 1, 1e-5),
    ],
)
def test_a_universal_checkpoint_resumes_at_any_stage_and_size(ranks, case, stage, world, tolerance):
    results = ranks(world).run(resume_and_step, case, stage, universal=True, timeout=TIMEOUT)
    for result in results:
        _check(result, case, tolerance)
        assert Path(result["path"]).name == TAG  # latest_universal, not latest


def test_a_universal_folder_loads_by_its_tag_without_the_key(ranks):
    for result in ranks(2).run(resume_and_step, "s3_ws2_2g", 2, tag=TAG, timeout=TIMEOUT):
        _check(result, "s3_ws2_2g", 1e-5)


@pytest.mark.parametrize("case", ["s2_ws2", "s3_ws2_2g"])
def test_a_universal_checkpoint_consolidates_to_deepspeeds_weights(case):
    state = get_fp32_state_dict(HERE / case / "ckpt", TAG)
    TinyNet().load_state_dict(state, strict=True)  # tied head, frozen parameter and buffer too
    for name, value in _expected(case)["saved_params"].items():
        assert torch.equal(state[name], value), name


def _copy(tmp_path: Path, name: str = "ckpt") -> Path:
    shutil.copytree(HERE / "s2_ws2" / "ckpt", tmp_path / name)
    return tmp_path / name


def logged_resume(folder) -> dict:
    with captured_logs() as logs:
        result = resume_and_step("s2_ws2", 2, folder, universal=True)
    return {**result, "logs": logs}


def test_load_universal_without_its_latest_file_falls_back_or_is_named(ranks, tmp_path):
    ckpt = _copy(tmp_path)
    (ckpt / "latest_universal").unlink()
    # `latest` names DeepSpeed's own checkpoint, which loads at any size as it is.
    for result in ranks(1).run(logged_resume, ckpt, timeout=TIMEOUT):
        _check(result, "s2_ws2", 1e-5)
        assert Path(result["path"]).name == "global_step3"
        (line,) = [m for m in result["logs"] if "no latest_universal file" in m]
        assert line.startswith("INFO: checkpoint.load_universal: ") and "'latest' names" in line
    (ckpt / "latest").unlink()
    with pytest.raises(Exception, match=r"load_universal is set, but .*latest_universal does not"):
        ranks(1).run(resume_and_step, "s2_ws2", 2, ckpt, universal=True, timeout=TIMEOUT)


def _damaged(tmp_path: Path, name: str, damage) -> str:
    ckpt = _copy(tmp_path, name)
    damage(ckpt / TAG / "zero")
    with pytest.raises(CheckpointError) as error:
        get_fp32_state_dict(ckpt, TAG)
    return str(error.value)


def test_a_damaged_universal_file_is_named(tmp_path):
    def cut(states):
        path = states / "fc1.weight" / "exp_avg.pt"
        saved = torch.load(path, weights_only=True)
        torch.save({**saved, "param": saved["param"][:-1]}, path)

    message = _damaged(tmp_path, "cut", cut)
    assert message.endswith(
        "cut/global_step3_universal/zero/fc1.weight/exp_avg.pt holds 468 elements; the "
        "parameter has 481: the file is from another model, or the checkpoint from a "
        "tensor-parallel run (not read)"
    )
    message = _damaged(tmp_path, "gone", lambda s: (s / "fc1.weight" / "fp32.pt").unlink())
    assert message.endswith("gone/global_step3_universal/zero/fc1.weight/fp32.pt is missing")
    message = _damaged(
        tmp_path, "junk", lambda s: (s / "ln.weight" / "exp_avg_sq.pt").write_bytes(b"junk")
    )
    assert "junk/global_step3_universal/zero/ln.weight/exp_avg_sq.pt cannot be read" in message
    message = _damaged(tmp_path, "step", lambda s: (s / "ln.bias" / "step.pt").unlink())
    assert message.endswith("zero/ln.bias has optimizer state but no step count")


# -- zerolap's ds_to_universal ------------------------------------------------------------------


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.pt"))


def test_zerolaps_converter_writes_what_deepspeeds_does(tmp_path):
    ckpt = _copy(tmp_path)
    write_universal(ckpt / "global_step3", ckpt / "mine")
    assert (ckpt / "latest_universal").read_text() == "mine"
    theirs, mine = ckpt / TAG / "zero", ckpt / "mine" / "zero"
    # Every parameter's, alias's and buffer's files, as DeepSpeed's converter writes them.
    assert _files(mine) == _files(theirs)
    for name in _files(theirs):
        want = load_file(theirs / name)
        got = torch.load(mine / name, weights_only=True)
        if name.endswith("step.pt"):  # a tensor, which torch's Adam needs (DeepSpeed: an int)
            assert isinstance(got, torch.Tensor) and got.item() == want == 3
        elif name.endswith("optimizer_state.pt"):
            # DeepSpeed's groups also carry its unused group "step" (0).
            assert got["param_groups"] == [
                {k: v for k, v in group.items() if k != "step"} for group in want["param_groups"]
            ]
            # Where stage 3 reads it, an int: DeepSpeed hands one object to every sub-group.
            assert got["optimizer_state_dict"]["state"] == {0: {"step": 3}}
            assert type(got["optimizer_state_dict"]["state"][0]["step"]) is int
        else:
            assert sorted(got) == sorted(want), name
            assert torch.equal(got["param"], want["param"]), name


def test_zerolaps_converter_takes_deepspeeds_stage_3_values(tmp_path):
    ckpt = HERE / "s3_ws2_2g" / "ckpt"
    with captured_logs() as logs:
        write_universal(ckpt / "global_step3", tmp_path / "mine")
    theirs, mine = ckpt / TAG / "zero", tmp_path / "mine" / "zero"
    # DeepSpeed's stage-3 layout (flat tensors, the step in optimizer_state.pt) is read by
    # both of its loaders in the stage 1-2 form zerolap writes, plus every parameter's step.
    assert set(_files(theirs)) < set(_files(mine))
    for name in _files(theirs):
        if not name.endswith("optimizer_state.pt"):
            want = torch.load(theirs / name, weights_only=True)
            got = torch.load(mine / name, weights_only=True)["param"]
            assert torch.equal(got.reshape(-1), want), name
    (warning,) = [m for m in logs if m.startswith("WARNING")]
    assert "param group 1 differs from group 0 in ['weight_decay']: DeepSpeed's ZeRO-3" in warning


def test_a_converted_file_whose_bytes_changed_is_named(tmp_path):
    ckpt = _copy(tmp_path)
    write_universal(ckpt / "global_step3", ckpt / "mine")
    path = ckpt / "mine" / "zero" / "fc1.weight" / "exp_avg.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit flipped, the size unchanged
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"fc1.weight/exp_avg.pt does not match the check"):
        get_fp32_state_dict(ckpt, "mine")


def test_a_converted_checkpoint_resumes_at_another_stage(ranks, tmp_path):
    ckpt = _copy(tmp_path)
    write_universal(ckpt / "global_step3", ckpt / "mine")
    for result in ranks(1).run(resume_and_step, "s2_ws2", 3, ckpt, universal=True):
        _check(result, "s2_ws2", 1e-5)
        assert Path(result["path"]).name == "mine"


def train_and_save(folder: str, stage: int, client: bool) -> None:
    """zerolap trains the fixtures' model 3 steps at ``stage`` on this job's ranks (``client``:
    with a torch AdamW of the client's) and saves."""
    import zerolap
    import zerolap.comm as dist
    from tests.checkpoint.deepspeed_0_19_8.model import LR, batch, build_model, ds_config

    model = build_model()
    config = ds_config(stage, dist.get_world_size(), False)
    optimizer = None
    if client:
        del config["optimizer"]
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    engine, *_ = zerolap.initialize(
        model=model, model_parameters=model.parameters(), optimizer=optimizer, config=config
    )
    for number in range(1, 4):
        engine.backward(engine(*batch(number, dist.get_rank())))
        engine.step()
    engine.save_checkpoint(folder)


@pytest.mark.parametrize(("stage", "client"), [(2, False), (3, False), (3, True)])
def test_a_zerolap_checkpoint_converts_whole(ranks, tmp_path, stage, client):
    # Stage 3 lists its frozen parameter among the optimizer's pieces as well as frozen.
    ranks(2).run(train_and_save, str(tmp_path), stage, client, timeout=TIMEOUT)
    with captured_logs() as logs:
        write_universal(tmp_path / "global_step3", tmp_path / "universal")
    client_note = "the run stepped its client's own optimizer: DeepSpeed resumes a torch"
    assert any(client_note in m for m in logs) == client, logs
    want = get_fp32_state_dict(tmp_path, "global_step3")
    got = get_fp32_state_dict(tmp_path, "universal")
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    TinyNet().load_state_dict(got, strict=True)


def test_a_conversion_that_fails_leaves_nothing(tmp_path, monkeypatch):
    import zerolap.checkpoint.files as files_module
    import zerolap.checkpoint.universal as universal

    ckpt = _copy(tmp_path)
    (ckpt / "latest_universal").unlink()
    written = []

    def failing(obj, path):
        if len(written) == 5:  # how torch.save reports a full disk
            raise RuntimeError("[enforce fail at inline_container.cc:664] . file write failed")
        written.append(path)

    # A killed conversion's folder on this host (no such process), and another host's.
    stale = ckpt / f".mine.partial-{socket.gethostname()}-999999999-0123abcd"
    elsewhere = ckpt / ".mine.partial-other-host-999999999-0123abcd"
    for folder in (stale, elsewhere):
        (folder / "zero").mkdir(parents=True)
    monkeypatch.setattr(files_module, "write", failing)
    with pytest.raises(CheckpointError, match=r"converting .*global_step3 to .*mine: .*write fail"):
        write_universal(ckpt / "global_step3", ckpt / "mine")
    assert sorted(p.name for p in ckpt.iterdir()) == [elsewhere.name, "global_step3", TAG, "latest"]
    monkeypatch.undo()
    # Without hard links, a copy; into a folder that is not there yet.
    monkeypatch.setattr(universal.os, "link", lambda *_: (_ for _ in ()).throw(OSError(1, "no")))
    write_universal(ckpt / "global_step3", tmp_path / "new" / "mine")
    written = tmp_path / "new" / "mine"
    assert (written / "zero_pp_rank_0_mp_rank_00_model_states.pt").read_bytes() == (
        written / "mp_rank_00_model_states.pt"
    ).read_bytes()
    assert (tmp_path / "new" / "latest_universal").read_text() == "mine"
    with pytest.raises(CheckpointError, match=f"{TAG} exists: name a new folder"):
        write_universal(ckpt / "global_step3", ckpt / TAG)
    with pytest.raises(CheckpointError, match="no optimizer state named by parameter"):
        write_universal(HERE / "s0_ws2" / "ckpt" / "global_step3", tmp_path / "s0")
    with pytest.raises(CheckpointError, match=r"mixture-of-experts parameters \(.*deepspeed_exp"):
        write_universal(HERE / "moe_s2_w4_ep2" / "ckpt" / "global_step2", tmp_path / "moe")


@pytest.mark.parametrize(
    ("case", "extra"),
    [
        ("s2_ws2", "mp_rank_01_model_states.pt"),  # a pipeline's second stage
        ("s3_ws2_2g", "zero_pp_rank_0_mp_rank_01_model_states.pt"),  # stage 3, tensor rank 1
    ],
)
def test_a_universal_checkpoint_of_several_model_files_is_refused(tmp_path, case, extra):
    shutil.copytree(HERE / case / "ckpt", tmp_path / "ckpt")
    folder = tmp_path / "ckpt" / TAG
    first = sorted(folder.glob("*model_states.pt"))[0]
    shutil.copy(first, folder / extra)
    with pytest.raises(CheckpointError, match="one model-states file per pipeline stage or"):
        get_fp32_state_dict(tmp_path / "ckpt", TAG)


def test_the_converter_answers_deepspeeds_command_line(tmp_path):
    ckpt = _copy(tmp_path)
    done = subprocess.run(
        [
            sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
            str(ckpt / "global_step3"), "--output_folder", str(ckpt / "cli"),
            "--num_extract_workers", "4", "--inject_missing_state", "--no_strict",
        ],
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--num_extract_workers, --no_strict: no effect on zerolap's conversion" in done.stderr
    assert (ckpt / "latest_universal").read_text() == "cli"
