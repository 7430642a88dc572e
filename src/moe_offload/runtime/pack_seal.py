"""The seal and the layout rules of a pack's manifest (runtime/packing.py): a packed model is read as it was
written, or refused naming the file and what is wrong.

**Seal.** The manifest's ``seal`` is the SHA-256 of the rest of the manifest in canonical JSON (sorted keys,
no spaces). That rest holds a digest of every file of the pack: per chunk of every expert (SHA-256 and
xxHash3), the non-expert file's SHA-256, and under ``files`` the SHA-256 of every copied file (config.json,
the tokenizer's). So a flipped bit anywhere, in the manifest or in a file, is a mismatch: the manifest's at
start-up (:func:`check_seal`), a config or tokenizer file's at start-up (:func:`check_copied_files`), the
non-expert file's when the skeleton loads, an expert chunk's on its first read (runtime/storage.py).

**Layout.** A checksum without a key cannot stop an edit that recomputes it, so the manifest must also
describe the one layout ``pack`` writes (:func:`check_layout`): layer ``l``'s experts in
``experts/layer{l:03d}.bin``, expert ``e`` at ``e * stride`` (``stride``: ``expert_bytes`` rounded up to
the 4 KiB alignment), the expert tensors one after the other from offset 0 with the bytes their shape and the
dtype give, the non-experts in ``non-experts.safetensors``. A manifest that points layer 3 at layer 1's file,
an expert at another's bytes, or a file outside the pack directory (``../``, an absolute path) is refused,
and so is one whose sizes are beyond any model (an expert of 2^62 bytes) before anything is allocated.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from moe_offload.hardware.choices import QUANTIZED
from moe_offload.inputs import check_input, file_sha256
from moe_offload.runtime.quantize import quantized_nbytes

SEAL_KEY = "seal"
FILES_KEY = "files"
ALIGNMENT = 4096  # expert regions start on page boundaries (O_DIRECT-ready, whole pages per read)
# Bounds of what a manifest may describe, checked before anything is built from it (trace/format.py's bounds:
# 16.7M experts is 250 times DeepSeek-V3's 61 x 256; 64 GiB an expert is 50 times Mixtral-8x22B's).
MAX_EXPERT_SLOTS = 2**24
MAX_EXPERT_BYTES = 2**36
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def layer_file(layer: int) -> str:
    return f"experts/layer{layer:03d}.bin"


def seal_of(document: dict) -> str:
    """SHA-256 of the manifest ``document`` without its seal, in canonical JSON."""
    body = {key: value for key, value in document.items() if key != SEAL_KEY}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_seal(document: dict, path, error: type) -> None:
    """``error`` unless the manifest ``document`` carries its own seal."""
    if document.get(SEAL_KEY) != seal_of(document):
        raise error(f"{path}: corrupt: the manifest does not match its seal (it changed after `moe-offload pack` "
                    "wrote it); pack the model again")


def check_layout(manifest, path, error: type) -> None:
    """``error`` unless ``manifest`` (a packing.Manifest) describes the layout of the module doc."""
    if not (1 <= manifest.num_layers and 1 <= manifest.num_experts
            and manifest.num_layers * manifest.num_experts <= MAX_EXPERT_SLOTS):
        raise error(f"{path}: {manifest.num_layers} layers x {manifest.num_experts} experts is not a model this "
                    f"release packs (at most {MAX_EXPERT_SLOTS:,} experts)")
    if manifest.dtype not in DTYPE_BYTES:
        raise error(f"{path}: dtype {manifest.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    if not 0 < manifest.expert_bytes <= MAX_EXPERT_BYTES or manifest.chunk_bytes <= 0:
        raise error(f"{path}: expert_bytes {manifest.expert_bytes} and chunk_bytes {manifest.chunk_bytes} must be "
                    f"positive, an expert at most {MAX_EXPERT_BYTES:,} bytes")
    if manifest.expert_dtype is not None and manifest.expert_dtype not in QUANTIZED:
        raise error(f"{path}: expert_dtype {manifest.expert_dtype!r} is not one of {', '.join(QUANTIZED)}")
    offset = 0
    for tensor in manifest.tensors:
        nbytes = quantized_nbytes(tensor.shape, manifest.expert_dtype) if manifest.quantized and tensor.shape else \
            math.prod(tensor.shape) * DTYPE_BYTES[manifest.dtype]
        if tensor.offset != offset or tensor.nbytes != nbytes or any(n <= 0 for n in tensor.shape):
            raise error(f"{path}: expert tensor {tensor.name} {list(tensor.shape)} at offset {tensor.offset} "
                        f"({tensor.nbytes} bytes) does not follow the tensors before it in "
                        f"{manifest.expert_dtype or manifest.dtype}")
        offset += nbytes
    if offset != manifest.expert_bytes:
        raise error(f"{path}: the expert tensors take {offset} bytes, expert_bytes says {manifest.expert_bytes}")
    stride = -(-manifest.expert_bytes // ALIGNMENT) * ALIGNMENT
    for layer, (name, nbytes) in enumerate(manifest.layer_files):
        if name != layer_file(layer) or nbytes != manifest.num_experts * stride:
            raise error(f"{path}: layer {layer}'s experts are in {name!r} ({nbytes} bytes); a pack keeps them in "
                        f"{layer_file(layer)!r} ({manifest.num_experts * stride} bytes)")
    for (layer, expert), entry in manifest.experts.items():
        if entry.offset != expert * stride:
            raise error(f"{path}: layer {layer} expert {expert} is at offset {entry.offset}; a pack keeps it at "
                        f"{expert * stride}")


def check_inside(directory: Path, name: str, path, error: type) -> Path:
    """``directory / name`` if it lies inside ``directory`` once symlinks are followed, else ``error``."""
    file = directory / name
    if Path(name).is_absolute() or directory.resolve() not in file.resolve().parents:
        raise error(f"{path}: {name!r} leads outside the pack directory {directory}")
    return file


def check_copied_files(document: dict, directory: Path, path, error: type) -> None:
    """``error`` unless every file the manifest's ``files`` lists is in the pack with its SHA-256."""
    files = document.get(FILES_KEY)
    if not isinstance(files, dict) or "config.json" not in files:
        raise error(f"{path}: lists no digest of config.json; pack the model again")
    for name, digest in files.items():
        file = check_input(check_inside(directory, name, path, error), "pack file", error)
        if file_sha256(file) != digest:
            raise error(f"{file}: checksum mismatch with the manifest (changed after packing); pack the model again")
