"""``--model NAME`` for the runtime: a packed directory as it is, or a checkpoint (``tiny``, a directory, a hub id,
a GGUF file) packed once into the cache (models/tiny.py ``cache_root``), under a name its weights decide, and
the files a command reading the model must not overwrite."""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from moe_offload.errors import ConfigError
from moe_offload.inputs import check_input, file_sha256, missing
from moe_offload.models.gguf import gguf_path, is_gguf, pack_key
from moe_offload.models.hub import hub_id, resolve
from moe_offload.models.tiny import cache_root, model_directory
from moe_offload.runtime.cpu_threads import single_threaded
from moe_offload.runtime.packing import FORMAT_VERSION, MANIFEST, check_expert_dtype, pack_model, read_manifest


def model_files(name: str) -> list[Path]:
    """Every file of the model ``--model NAME`` names (a packed directory, or a checkpoint and its packed
    copies in the cache): inputs of the command that runs it, which none of its outputs may overwrite
    (outputs.check_output)."""
    directory = model_directory(name)
    if directory.is_file():  # a GGUF file (models/gguf.py)
        return [directory]
    if not directory.is_dir():
        return []
    folders = [directory]
    if missing(directory / MANIFEST):  # a checkpoint: its packs in the cache too (packed_directory's names)
        folders += sorted((cache_root() / "packed").glob(f"{glob.escape(directory.resolve().name)}-*"))
    return [path for folder in folders for path in folder.rglob("*") if path.is_file()]


def packed_directory(name: str, on_expert=None, expert_dtype: str | None = None) -> Path:
    """``--model NAME`` for the runtime: a packed directory as is; ``tiny`` or a checkpoint directory packed
    once into the cache, in a directory named after its weights' checksum so that a retrained or replaced
    checkpoint is packed anew instead of serving a stale pack; a hub id (models/hub.py) packed once per
    repository and commit; a GGUF file (models/gguf.py) once per its SHA-256 or hub commit. Each ``expert_dtype``
    (None: the checkpoint's) has its own pack."""
    check_expert_dtype(expert_dtype)
    if is_gguf(name):
        path, commit = gguf_path(name)
        return _packed_once(path, pack_key(name, path, commit), on_expert, expert_dtype)

    if hub_id(name) is not None:  # a hub snapshot: its commit pins its files, no need to hash them
        hub = resolve(name)
        return _packed_once(hub.directory, f"{hub.repo_id.replace('/', '--')}-{hub.commit[:12]}", on_expert,
                            expert_dtype)
    directory = model_directory(name)
    if missing(directory):
        raise ConfigError(f"{directory}: no such model directory")
    if not os.path.isdir(directory):
        check_input(directory, "model directory")  # the reason it cannot be looked up (a name too long)
        raise ConfigError(f"{directory}: not a directory (give a packed model or a checkpoint directory)")
    if not missing(directory / MANIFEST):  # a pack, even one that cannot be read: read_manifest says why
        if expert_dtype is not None:
            packed = read_manifest(directory, check_files=False)
            if expert_dtype != (packed.expert_dtype or packed.dtype):
                raise ConfigError(f"{directory}: packed with {packed.expert_dtype or packed.dtype} experts, not "
                                  f"{expert_dtype}: pack the checkpoint with --expert-dtype {expert_dtype}")
        return directory
    if missing(directory / "config.json"):
        raise ConfigError(f"{directory}: not a model: neither a packed model ({MANIFEST}) nor a checkpoint "
                          "(config.json)")
    weights = [check_input(file, "weight file") for file in sorted(directory.glob("*.safetensors"))]
    if not weights:
        raise ConfigError(f"{directory}: no weight file (*.safetensors) in the model directory")
    digest = hashlib.sha256("".join(file_sha256(file) for file in weights).encode()).hexdigest()[:12]
    return _packed_once(directory, f"{directory.resolve().name}-{digest}", on_expert, expert_dtype)


def _packed_once(directory: Path, key: str, on_expert, expert_dtype: str | None) -> Path:
    """The pack of the checkpoint ``directory`` with ``expert_dtype`` experts in the cache under ``key`` (what
    identifies its weights), written there the first time."""
    # the format version in the name: a pack written by another release is never served
    target = cache_root() / "packed" / f"{key}{'-' + expert_dtype if expert_dtype else ''}-v{FORMAT_VERSION}"
    if (target / MANIFEST).is_file():
        return target
    print(f"packing {directory} into {target} (once)", file=sys.stderr)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{target.name}-", dir=target.parent))
    except OSError as exc:
        raise ConfigError(f"{target.parent}: cannot create the pack cache: {exc.strerror or exc}") from None
    try:  # pack aside, then rename: an interrupted pack never looks finished
        with single_threaded():  # no OpenMP team left behind in the caller's thread (runtime/cpu_threads.py)
            pack_model(directory, staging / "packed", on_expert=on_expert, expert_dtype=expert_dtype)
        try:
            (staging / "packed").rename(target)
        except OSError:
            if not (target / MANIFEST).is_file():  # not just another process that finished first
                raise ConfigError(f"{target}: cannot install the packed model") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
