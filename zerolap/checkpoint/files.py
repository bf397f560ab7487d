"""Checkpoint files: DeepSpeed's names, and writes that a crash cannot half-finish.

Layout of ``save_dir``::

    latest                                   the tag of the newest complete checkpoint
    <tag>/mp_rank_00_model_states.pt         module, counters, scheduler, scaler (rank 0)
    <tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   rank r's optimizer shard and RNG

    <tag>/checksums.json                     the save's identity and every file's digest

A save writes into ``<tag>.partial`` (each file through a temporary name and ``os.replace``),
then rank 0 renames the folder to ``<tag>`` and only then points ``latest`` at it. A process
killed at any moment leaves the previous checkpoint and ``latest`` as they were.

Every file records the save it belongs to (tag, step and a save id all ranks share), and
``checksums.json`` the BLAKE2b digest of each file's bytes. A load checks both before it
trusts anything: a file whose bytes changed after the save, or one left over from another save,
is an error naming it. (Checkpoints without ``checksums.json``, written by DeepSpeed or an
earlier zerolap, load unchecked.) A load overtaken by a re-save of its tag reads again
(``checkpoint.engine_io``): ``tag_identity`` tells it that the save changed under it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

# zerolap's logger by name: zerolap.utils reaches this package (zero_to_fp32), not the reverse.
logger = logging.getLogger("zerolap")

__all__ = [
    "LATEST",
    "MODEL_FILE",
    "CheckpointError",
    "find_latest",
    "no_latest",
    "optim_file",
    "publish",
    "read",
    "read_checkpoint",
    "read_latest",
    "saved_identity",
    "tag_folder",
    "tag_identity",
    "try_write",
    "verify",
    "write",
    "write_checksums",
    "write_text",
]

MODEL_FILE = "mp_rank_00_model_states.pt"
LATEST = "latest"
RECOVERY_SCRIPT = "zero_to_fp32.py"
_RECOVERY_TEXT = '''#!/usr/bin/env python
"""The fp32 weights of the checkpoints in this folder, as DeepSpeed's zero_to_fp32.py:
python zero_to_fp32.py . output_dir [--safe_serialization] [--max_shard_size 5GB] [-t TAG]
(written by zerolap; needs zerolap installed)."""

from zerolap.utils.zero_to_fp32 import main

if __name__ == "__main__":
    main()
'''
CHECKSUMS = "checksums.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or does not fit the model."""


def optim_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def partial_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f"{tag}.partial"


def write(obj, path: Path) -> str:
    """``torch.save`` to a temporary name, then rename: the file is whole or absent. Returns
    the digest of its bytes."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)
    return digest(path)


def try_write(obj, path: Path) -> tuple[str | None, str | None]:
    """``write``, or why it could not: ``(digest, None)`` or ``(None, reason)``. A disk without
    room for the file's tensors fails before any byte is written; one that fills up meanwhile
    (torch reports it as ``enforce fail at inline_container.cc``) is said the same way."""
    needed = _tensor_bytes(obj)
    free = shutil.disk_usage(path.parent).free
    if free < needed:
        return None, _no_space(path, needed, free)
    try:
        return write(obj, path), None
    except (OSError, RuntimeError) as err:
        _remove_temporaries(path)
        free = shutil.disk_usage(path.parent).free
        if getattr(err, "errno", None) == errno.ENOSPC or free < needed:
            return None, _no_space(path, needed, free)
        return None, f"could not write {path}: {err}"


def _no_space(path: Path, needed: int, free: int) -> str:
    return (
        f"no space left on the device of {path.parent} writing {path.name}: about {needed:,} "
        f"bytes needed, {free:,} free ({max(needed - free, 0):,} short)"
    )


def _remove_temporaries(path: Path) -> None:
    for tmp in path.parent.glob(f".{path.name}.tmp-*"):
        tmp.unlink(missing_ok=True)


def _tensor_bytes(obj, seen: set | None = None) -> int:
    """Bytes of the tensors in ``obj``, each storage once as ``torch.save`` writes it (a lower
    bound of the file's size)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key in seen:
            return 0
        seen.add(key)
        return storage.nbytes()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v, seen) for v in obj)
    return 0


def digest(path: Path) -> str:
    """BLAKE2b (128 bits) of the file's bytes, read in 8 MiB pieces."""
    hasher = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as file:
        while piece := file.read(8 << 20):
            hasher.update(piece)
    return hasher.hexdigest()


def write_checksums(folder: Path, save: dict, digests: dict[str, str]) -> None:
    """``checksums.json``: the save's identity and the digest of every file, by name."""
    write_text(folder / CHECKSUMS, json.dumps({"save": save, "files": digests}, indent=1))


def _recorded(folder: Path) -> tuple[dict, dict] | None:
    """``checksums.json``'s save identity and digests (None for a checkpoint without it)."""
    path = folder / CHECKSUMS
    if not path.is_file():
        return None
    try:
        recorded = json.loads(path.read_text())
        return recorded["save"], recorded["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path} is damaged: {err}") from None


def saved_identity(folder: Path) -> dict | None:
    """The identity (tag, step, save id) of the save in ``folder`` as ``checksums.json``
    records it; None without one (or with no folder: a re-save is moving it)."""
    try:
        recorded = _recorded(folder)
    except (CheckpointError, OSError):
        return None
    return None if recorded is None else recorded[0]


def verify(folder: Path, share: tuple[int, int] = (0, 1)) -> dict | None:
    """Check the files ``checksums.json`` lists against their digests, those of ``share``
    ``(index, count)`` only (the ranks of a load split the hashing: file i is rank i mod
    count's); returns the save's identity (None for a checkpoint without checksums)."""
    recorded = _recorded(folder)
    if recorded is None:
        return None
    save, files = recorded
    index, count = share
    for name, expected in sorted(files.items())[index::count]:
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"missing {file}, which save {save['id']} wrote")
        if digest(file) != expected:
            raise CheckpointError(
                f"{file} does not match the checksum its save recorded: its bytes changed "
                "after the save (damaged, or replaced by another file)"
            )
    return save


def check_same_save(file: Path, payload: dict, save: dict | None) -> None:
    """A file read from a checkpoint belongs to the save ``checksums.json`` names."""
    mine = payload.get("save")
    if save is not None and mine != save:
        raise CheckpointError(
            f"{file} belongs to another save ({mine}) than the checkpoint's ({save}): a file "
            "left over from an earlier save or copied in"
        )


def write_text(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary name: readers see the old or the new."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def publish(save_dir: Path, tag: str, *, save_latest: bool) -> None:
    """Rank 0, after every rank wrote its files: ``<tag>.partial`` becomes ``<tag>``."""
    final, staged = save_dir / tag, partial_dir(save_dir, tag)
    old = save_dir / f"{tag}.old"
    if final.exists():
        # At every instant one complete save of the tag is on disk: the old one is moved
        # aside, not deleted, until the new one is in (``tag_folder`` finds it in between).
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staged, final)
    else:
        os.replace(staged, final)
    shutil.rmtree(old, ignore_errors=True)  # also what an interrupted re-save left aside
    if save_latest:
        write_text(save_dir / LATEST, tag)
    # The weights' recovery script beside the tags, where DeepSpeed leaves its own and where
    # transformers and Accelerate tell users to run it.
    script = save_dir / RECOVERY_SCRIPT
    write_text(script, _RECOVERY_TEXT)
    script.chmod(0o755)


def _find_tag(load_dir: Path, tag: str) -> Path | None:
    """``<tag>``, else ``<tag>.old`` when it holds a save, else None."""
    folder = load_dir / tag
    if folder.is_dir():
        return folder
    aside = load_dir / f"{tag}.old"
    if aside.is_dir() and (aside / MODEL_FILE).is_file():
        return aside
    return None


def tag_folder(load_dir: Path, tag: str, *, who: str = "") -> Path:
    """The folder holding checkpoint ``tag``. A re-save of a tag moves the old folder aside
    (``<tag>.old``) and then moves the new one in: killed between the two, the tag's folder is
    missing and the aside one is the last complete save, which is what loads (with a warning)."""
    folder = _find_tag(load_dir, tag)
    if folder is None:
        raise CheckpointError(f"{who}tag {tag!r} not found in {load_dir}")
    if folder.name != tag:
        logger.warning(
            f"{who}checkpoint {tag!r}: its re-save was interrupted before publication; "
            f"loading the previous complete save, {folder}"
        )
    return folder


def tag_identity(load_dir: Path, tag: str) -> dict | None:
    """The identity of the save ``tag`` names now (``saved_identity`` of its folder)."""
    folder = _find_tag(load_dir, tag)
    return None if folder is None else saved_identity(folder)


def find_latest(load_dir: Path, latest: str = LATEST) -> str | None:
    """The tag ``load_dir/latest`` names (or the file named ``latest``), or None when there is
    no such file."""
    path = load_dir / latest
    try:
        tag = path.read_text().strip()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    if not tag:
        raise CheckpointError(f"{path} is empty: it should name the newest checkpoint's tag")
    return tag


def no_latest(load_dir: Path) -> str:
    """Why ``load_dir`` names no checkpoint, and which tags it holds if any."""
    if not load_dir.is_dir():
        return f"{load_dir} is not a directory"
    tags = sorted(p.name for p in load_dir.iterdir() if (p / MODEL_FILE).is_file())
    hint = f"; it holds tags {tags}, pass one as tag=" if tags else ""
    return f"no 'latest' file in {load_dir}{hint}"


def read_latest(load_dir: Path) -> str:
    """The tag ``load_dir/latest`` names; an error saying what is there when it is absent."""
    tag = find_latest(load_dir)
    if tag is None:
        raise CheckpointError(f"not a checkpoint directory: {no_latest(load_dir)}")
    return tag


def read_checkpoint(folder: Path, loading=None, *, hashed: bool = False) -> tuple[dict, list[dict]]:
    """The model states and every rank's shard of the checkpoint in ``folder``, saved by
    zerolap or by DeepSpeed (converted to zerolap's form, ``checkpoint.deepspeed_format``,
    with what the ``loading`` engine knows of its model: a ``LoadingModel``), or converted by
    DeepSpeed's ``ds_to_universal`` (``checkpoint.universal``). Its files'
    bytes are checked against their digests unless the caller did (``hashed``)."""
    from zerolap.checkpoint.deepspeed_format import is_deepspeed_checkpoint, read_deepspeed
    from zerolap.checkpoint.universal import is_universal_checkpoint, read_universal

    if is_universal_checkpoint(folder):
        if not hashed:
            verify(folder)  # zerolap's conversions record checksums; DeepSpeed's do not
        return read_universal(folder)
    if not (folder / MODEL_FILE).is_file() and is_deepspeed_checkpoint(folder):
        return read_deepspeed(folder, loading)  # stage 3: one model file per rank
    if hashed:
        recorded = _recorded(folder)
        save = None if recorded is None else recorded[0]
    else:
        save = verify(folder)
    saved = read(folder / MODEL_FILE, what="model states")
    if is_deepspeed_checkpoint(folder, saved):
        return read_deepspeed(folder, loading)
    check_same_save(folder / MODEL_FILE, saved, save)
    save = save or saved.get("save")  # without checksums.json, the model file's save rules
    shards = []
    for r in range(saved["world_size"]):
        shard = read(folder / optim_file(r), what=f"optimizer shard of rank {r}")
        check_same_save(folder / optim_file(r), shard, save)
        shards.append(shard)
    return saved, shards


def read(path: Path, *, what: str):
    """Load one checkpoint file, memory-mapped (tensors are read when touched)."""
    if not path.is_file():
        raise CheckpointError(f"missing {what}: {path}")
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as err:  # a truncated zip, a foreign file: say which file, not why torch
        raise CheckpointError(
            f"{what} {path} is truncated or not a checkpoint file: {err}"
        ) from None
