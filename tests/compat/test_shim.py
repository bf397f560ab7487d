"""The ``deepspeed`` shim (``compat/``): installed by ``make``, it answers ``import deepspeed``
with zerolap's modules, with metadata and a version that DeepSpeed's clients accept, and its
build refuses to replace a real DeepSpeed."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.version import Version

import zerolap
from zerolap.aliases import MODULES, deepspeed_version
from zerolap.report import deepspeed_status

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def deepspeed():
    status = deepspeed_status()
    if status.startswith("real DeepSpeed"):
        pytest.skip(f"a real DeepSpeed is installed here: {status}")
    assert "zerolap's shim" in status, f"the shim is not installed ({status}): run make"
    return importlib.import_module("deepspeed")


def test_the_shim_version_says_which_deepspeed_and_which_zerolap(deepspeed):
    pyproject = tomllib.loads((ROOT / "compat" / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == deepspeed_version(zerolap.__version__)
    assert importlib.metadata.version("deepspeed") == deepspeed.__version__
    assert Version(deepspeed.__version__) >= Version("0.18.2")  # every accelerate gate passes
    assert deepspeed.__version__.endswith(f"+zerolap.{zerolap.__version__}")


@pytest.mark.parametrize("path", sorted(MODULES))
@pytest.mark.filterwarnings("ignore:deepspeed.compression.helper is deprecated:FutureWarning")
def test_every_deepspeed_path_is_the_zerolap_module(deepspeed, path):
    module = importlib.import_module(f"deepspeed.{path}")
    assert module is importlib.import_module(MODULES[path])
    assert module.__spec__.name == MODULES[path]  # the module keeps its own identity
    # ... and is reachable as attributes after a bare import, as DeepSpeed's eager imports make it
    target = deepspeed
    for part in path.split("."):
        target = getattr(target, part)
    assert target is module


def test_names_clients_use_after_import_deepspeed(deepspeed):
    assert deepspeed.initialize is zerolap.initialize
    assert deepspeed.DeepSpeedEngine is zerolap.ZerolapEngine
    assert "WarmupLR" in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
    assert deepspeed.zero.GatheredParameters is zerolap.zero.GatheredParameters
    assert deepspeed.runtime.zero.partition_parameters.ZeroParamStatus.AVAILABLE
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save  # noqa: F401
    from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME  # noqa: F401
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam  # noqa: F401
    from deepspeed.utils import logger, set_z3_leaf_modules  # noqa: F401


def test_an_unmapped_path_is_a_clean_import_error(deepspeed):
    with pytest.raises(ModuleNotFoundError, match=r"deepspeed\.ops\.transformer"):
        importlib.import_module("deepspeed.ops.transformer")
    # a zerolap file under a mapped package is not loaded a second time under a DeepSpeed name
    with pytest.raises(ModuleNotFoundError, match=r"deepspeed\.runtime\.optimizers"):
        importlib.import_module("deepspeed.runtime.optimizers")


def test_transformers_and_accelerate_see_deepspeed(deepspeed):
    transformers = pytest.importorskip("transformers.integrations.deepspeed")
    assert transformers.is_deepspeed_available()
    from accelerate.utils import compare_versions, is_deepspeed_available

    assert is_deepspeed_available() and compare_versions("deepspeed", ">=", "0.16.4")


def test_report_names_the_active_deepspeed(deepspeed):
    out = subprocess.run(
        [sys.executable, "-m", "zerolap.cli", "report"], capture_output=True, text=True, check=True
    ).stdout
    assert "deepspeed import" in out and "zerolap's shim 0.19.8+zerolap" in out


def test_deepspeed_modules_run_as_scripts(deepspeed):
    # runpy asks the alias's loader for the code (it had no get_code: an AttributeError).
    done = subprocess.run(
        [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "checkpoint_dir" in done.stdout and "--safe_serialization" in done.stdout


def _fake_environment(root: Path, version: str) -> Path:
    """A virtual environment (no pip) whose site-packages holds a ``deepspeed`` dist-info."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next(root.glob("lib/python*/site-packages"))
    info = site / f"deepspeed-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n")
    return root / "bin" / "python"


def test_the_build_refuses_to_replace_a_real_deepspeed(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "compat"))
    try:
        guard = importlib.import_module("build_guard")
    finally:
        sys.path.pop(0)
    real = _fake_environment(tmp_path / "real", "0.19.8")
    assert guard.find_deepspeed(str(real))[0] == "0.19.8"
    monkeypatch.setattr(sys, "executable", str(real))
    with pytest.raises(SystemExit, match=r"a real DeepSpeed 0\.19\.8 is installed"):
        guard.build_wheel(str(tmp_path / "wheel"))
    shim = _fake_environment(tmp_path / "shim", deepspeed_version(zerolap.__version__))
    monkeypatch.setattr(sys, "executable", str(shim))
    guard._refuse_real_deepspeed()  # upgrading zerolap's own shim is fine
    empty = tmp_path / "empty"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(empty)], check=True)
    assert guard.find_deepspeed(str(empty / "bin" / "python")) is None
