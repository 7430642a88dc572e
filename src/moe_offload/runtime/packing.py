"""Packed checkpoints: the non-expert weights in one file, the routed experts of each layer in one file of
raw tensor bytes at offsets the manifest gives (FlashMoE's separation, paper 003).

``moe-offload pack MODEL -o DIR`` writes (format version 3)::

    DIR/moe-offload-pack.json        the manifest (below)
    DIR/config.json, tokenizer files  copied from MODEL
    DIR/non-experts.safetensors       attention, norms, routers, shared experts, embeddings, LM head
    DIR/experts/layer003.bin          layer 3's experts, each at an offset aligned to 4 KiB

An expert's region holds its tensors one after the other in ``EXPERT_TENSORS`` order (``gate_up_proj`` [2I, H],
``down_proj`` [H, I], the expert dtype, row-major, no header; ``int8``/``int4`` experts: each tensor's quantized
values then its group scales, runtime/quantize.py, with the manifest's ``expert_dtype`` naming the format and
``dtype`` the float dtype they stand for), so the runtime reads an expert with one
positional read into a reusable buffer and makes its tensors as views, with no parsing on the hot path.
The manifest lists, once for all experts, each tensor's offset, shape and byte size inside a region (so a
part of an expert can be read on its own: MoEpic's split along the intermediate dimension reads the
intermediate rows [a, b) of gate_up_proj as the two ranges of its gate and up halves, and down_proj's
columns as H runs), and per expert its file offset and one SHA-256 and one xxHash3-64 digest per chunk of
``chunk_bytes``. The runtime checks a chunk's SHA-256 the first time it reads it in a process, and its
xxHash3 (an order of magnitude faster) on every later read (runtime/storage.py). The manifest also holds the
SHA-256 of the non-expert file and of every copied file, and is sealed with a SHA-256 of itself; a manifest
that does not match its seal, or describes another layout than this one, is refused (runtime/pack_seal.py).
Before packing, the checkpoint itself is checked (runtime/checkpoint_checks.py).

Versions 1 (one safetensors file per expert) and 2 (no seal) are not read any more; the pack cache's directory
names carry the format version, so a stale pack is never served (``packed_directory``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from moe_offload.errors import ConfigError, MoeOffloadError
from moe_offload.inputs import check_input, missing, parse_json, read_text
from moe_offload.runtime.pack_seal import (ALIGNMENT, FILES_KEY, SEAL_KEY, check_copied_files, check_inside,
                                           check_layout, check_seal, file_sha256, layer_file, seal_of)

MANIFEST = "moe-offload-pack.json"
NON_EXPERTS = "non-experts.safetensors"
FORMAT_VERSION = 3  # 3: the manifest is sealed (runtime/pack_seal.py)
# One checksum per 8 MiB: a reader verifies and converts its chunk while it is still in cache, and each chunk
# costs the reader pool some Python (a task, the calls around preadv and the hash) that holds the GIL the
# decode thread needs: with 1 MiB chunks, on an H100 (wide model, 48 MiB experts), the link moved 4.5 GB/s and
# prefetching with the oracle slowed decoding by up to 1.56x; with 8 MiB, 10 GB/s and never slower (README).
CHUNK_BYTES = 8 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja")


class PackError(MoeOffloadError):
    """A packed model directory is missing a file, or a file does not match the manifest."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of every expert: where it lies inside the expert's region."""

    name: str
    shape: tuple[int, ...]
    offset: int   # bytes from the start of the expert's region
    nbytes: int


@dataclass(frozen=True)
class ExpertEntry:
    layer: int
    expert: int
    offset: int                 # bytes from the start of the layer file
    sha256: tuple[str, ...]     # one per chunk of the region
    xxh3: tuple[str, ...]


@dataclass
class Manifest:
    directory: Path
    model_type: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    dtype: str
    expert_bytes: int  # tensor bytes of one expert as stored (the region's size)
    decoder_layers: list[int]
    tensors: tuple[TensorEntry, ...]
    chunk_bytes: int
    layer_files: list[tuple[str, int]]  # (path relative to the directory, size in bytes) per MoE layer
    experts: dict[tuple[int, int], ExpertEntry]
    non_experts_sha256: str
    tied: dict[str, str]  # parameter -> the parameter it shares storage with (tied embeddings)
    max_position_embeddings: int | None = None
    expert_dtype: str | None = None  # int8 / int4: the experts are quantized (runtime/quantize.py); else None

    @property
    def quantized(self) -> bool:
        return self.expert_dtype is not None

    def layer_path(self, layer: int) -> Path:
        return self.directory / self.layer_files[layer][0]

    def chunks(self) -> list[tuple[int, int]]:
        """(start, end) of every checksum chunk of an expert's region."""
        return [(start, min(start + self.chunk_bytes, self.expert_bytes))
                for start in range(0, self.expert_bytes, self.chunk_bytes)]


def chunk_digests(data, chunk_bytes: int) -> tuple[list[str], list[str]]:
    """(SHA-256, xxHash3-64) hex digests of every ``chunk_bytes`` of ``data``."""
    import xxhash

    view = memoryview(data)
    sha, xxh = [], []
    for start in range(0, len(view), chunk_bytes):
        chunk = view[start:start + chunk_bytes]
        sha.append(hashlib.sha256(chunk).hexdigest())
        xxh.append(xxhash.xxh3_64_hexdigest(chunk))
    return sha, xxh


def expert_parameter_names(adapter) -> set[str]:
    """Qualified names of the fused expert tensors (what the pack moves out of the non-expert file)."""
    names = set()
    for prefix, module in adapter.model.named_modules():
        if any(module is adapter.experts(layer) for layer in range(adapter.num_layers)):
            names.update(f"{prefix}.{tensor}" for tensor in adapter.EXPERT_TENSORS)
    return names


def pack_model(model_dir, out_dir, on_expert=None, expert_dtype: str | None = None) -> Manifest:
    """Split the checkpoint in ``model_dir`` into ``out_dir`` (see the module docstring), its experts stored as
    ``expert_dtype`` (runtime/quantize.EXPERT_DTYPES; None: as the checkpoint stores them). ``out_dir`` is checked
    before any work (it must not exist, or be an empty directory, in a writable folder) and written atomically:
    an interrupted or failed pack leaves nothing behind."""
    import torch

    from moe_offload.models.adapters import load_model, read_config
    from moe_offload.outputs import atomic_directory, check_output
    from moe_offload.runtime.checkpoint_checks import check_checkpoint_files, check_loaded_weights

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_expert_dtype(expert_dtype)
    check_output(out_dir, inputs=[model_dir], directory=True, what="packed model")
    if model_dir.is_file():  # a GGUF file: packed from the float checkpoint transformers reads it as
        from moe_offload.models.gguf import float_checkpoint

        with float_checkpoint(model_dir, beside=out_dir.resolve().parent) as checkpoint:
            return pack_model(checkpoint, out_dir, on_expert, expert_dtype)
    raw = check_checkpoint_files(model_dir)  # before transformers reads a file (runtime/checkpoint_checks.py)
    config = read_config(model_dir)
    stored = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    dtype = getattr(torch, stored, None) if isinstance(stored, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"{model_dir / 'config.json'}: unknown dtype {stored!r}")
    model, adapter = load_model(model_dir, dtype=dtype)
    check_loaded_weights(model)
    with atomic_directory(out_dir) as staging:
        _write_pack(model, adapter, config, stored, model_dir, staging, on_expert, expert_dtype or stored)
    return read_manifest(out_dir)


def check_expert_dtype(expert_dtype: str | None) -> None:
    from moe_offload.plan.choices import EXPERT_DTYPES

    if expert_dtype is not None and expert_dtype not in EXPERT_DTYPES:
        raise ConfigError(f"--expert-dtype {expert_dtype!r}: choose from {', '.join(EXPERT_DTYPES)}")


def _write_pack(model, adapter, config, stored: str, model_dir: Path, out_dir: Path, on_expert,
                expert_dtype: str) -> None:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    (out_dir / "experts").mkdir()
    expert_names = expert_parameter_names(adapter)
    non_experts, tied, seen = {}, {}, {}
    for name, tensor in model.state_dict().items():
        if name in expert_names:
            continue
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key in seen:  # safetensors refuses shared storage: keep one copy, re-tie at load
            tied[name] = seen[key]
            continue
        seen[key] = name
        non_experts[name] = tensor.contiguous()
    try:
        save_file(non_experts, out_dir / NON_EXPERTS, metadata={"format": "pt"})
    except SafetensorError as exc:  # its error for a failed write (a full disk): an OSError for atomic_directory
        raise OSError(str(exc)) from None

    from moe_offload.runtime.quantize import QUANTIZED, quantize, quantized_nbytes

    quantized = expert_dtype in QUANTIZED
    dtype = stored if quantized else expert_dtype  # the float dtype the experts' bytes stand for

    def stored_bytes(tensor):
        if quantized:
            return quantize(tensor, expert_dtype)
        return tensor.to(getattr(torch, dtype)).contiguous().reshape(-1).view(torch.uint8)

    first = adapter.expert_tensors(0, 0)
    tensors, offset = [], 0
    for name in adapter.EXPERT_TENSORS:
        shape = tuple(first[name].shape)
        nbytes = quantized_nbytes(shape, expert_dtype) if quantized else \
            first[name].numel() * getattr(torch, dtype).itemsize
        tensors.append({"name": name, "shape": list(first[name].shape), "offset": offset, "bytes": nbytes})
        offset += nbytes
    expert_bytes = offset
    stride = -(-expert_bytes // ALIGNMENT) * ALIGNMENT
    layers, experts = [], []
    for layer in range(adapter.num_layers):
        path = out_dir / layer_file(layer)
        with open(path, "wb") as handle:
            for expert in range(adapter.num_experts):
                parts = adapter.expert_tensors(layer, expert)
                region = torch.cat([stored_bytes(parts[name]) for name in adapter.EXPERT_TENSORS]).numpy()
                handle.write(memoryview(region))
                handle.write(bytes(stride - expert_bytes))
                sha, xxh = chunk_digests(region, CHUNK_BYTES)
                experts.append({"layer": layer, "expert": expert, "offset": expert * stride, "sha256": sha,
                                "xxh3": xxh})
                if on_expert:
                    on_expert()
        layers.append({"file": path.relative_to(out_dir).as_posix(), "bytes": path.stat().st_size})
    copied = {}
    for name in ("config.json", *TOKENIZER_FILES):
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out_dir / name)
            copied[name] = file_sha256(out_dir / name)
    manifest = {
        "format_version": FORMAT_VERSION, "model_type": config.model_type, "source": str(model_dir.resolve()),
        "num_layers": adapter.num_layers, "num_experts": adapter.num_experts, "top_k": adapter.top_k,
        "hidden_size": adapter.hidden_size, "dtype": dtype, "expert_bytes": expert_bytes,
        **({"expert_dtype": expert_dtype} if quantized else {}),
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        "decoder_layers": adapter.decoder_layers, "tied": tied,
        "non_experts": {"file": NON_EXPERTS, "sha256": file_sha256(out_dir / NON_EXPERTS)},
        "expert_tensors": tensors, "chunk_bytes": CHUNK_BYTES, "layers": layers, "experts": experts,
        FILES_KEY: copied,
    }
    manifest[SEAL_KEY] = seal_of(manifest)
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def read_manifest(directory, check_files: bool = True) -> Manifest:
    """The manifest of a packed directory, checked against its seal and the pack layout (runtime/pack_seal.py);
    with ``check_files``, every file of the pack must be a readable file inside the directory, the layer files
    of the manifest's sizes (a cheap stat each, so a missing or truncated file is reported at start-up) and the
    copied files (config, tokenizer) of their digests."""
    directory = Path(directory)
    path = directory / MANIFEST
    if missing(path):
        raise PackError(f"{path}: missing; is {directory} a directory written by `moe-offload pack`?")
    data = parse_json(read_text(path, "pack manifest", PackError), path, "pack manifest", PackError)
    if not isinstance(data, dict):
        raise PackError(f"{path}: a pack manifest is a JSON object, not {type(data).__name__}")
    if data.get("format_version") != FORMAT_VERSION:
        raise PackError(f"{path}: format version {data.get('format_version')!r}, this release reads "
                        f"{FORMAT_VERSION}: pack the model again (`moe-offload pack`)")
    check_seal(data, path, PackError)
    manifest = _manifest(data, directory, path)
    if check_files:
        for layer, (name, nbytes) in enumerate(manifest.layer_files):
            file = check_inside(directory, name, path, PackError)
            if missing(file):
                raise PackError(f"experts of layer {layer}: {file}: missing")
            check_input(file, "layer file", PackError)
            size = file.stat().st_size
            if size != nbytes:
                raise PackError(f"experts of layer {layer}: {file}: {size} bytes, the manifest says {nbytes} "
                                "(truncated or replaced)")
        check_input(check_inside(directory, NON_EXPERTS, path, PackError), "non-expert weight file", PackError)
        check_copied_files(data, directory, path, PackError)
        config = directory / "config.json"  # read by transformers next: standard JSON, an object
        if not isinstance(parse_json(read_text(config, "model config", PackError), config, "model config",
                                     PackError), dict):
            raise PackError(f"{config}: a model config must be a JSON object")
    return manifest


def _manifest(data: dict, directory: Path, path: Path) -> Manifest:
    """The Manifest the sealed document ``data`` describes, once its layout is the pack's (pack_seal.py)."""
    try:
        num_layers, num_experts = int(data["num_layers"]), int(data["num_experts"])
        if len(data["experts"]) != num_layers * num_experts:  # before building anything of that size
            raise PackError(f"{path}: lists {len(data['experts'])} experts, expected {num_layers} x {num_experts}")
        experts = {}
        for entry in data["experts"]:
            item = ExpertEntry(int(entry["layer"]), int(entry["expert"]), int(entry["offset"]),
                               tuple(map(str, entry["sha256"])), tuple(map(str, entry["xxh3"])))
            experts[(item.layer, item.expert)] = item
        tensors = tuple(TensorEntry(str(t["name"]), tuple(int(n) for n in t["shape"]), int(t["offset"]),
                                    int(t["bytes"])) for t in data["expert_tensors"])
        manifest = Manifest(directory, data["model_type"], num_layers, num_experts,
                            int(data["top_k"]), int(data["hidden_size"]), str(data["dtype"]),
                            int(data["expert_bytes"]), [int(i) for i in data["decoder_layers"]], tensors,
                            int(data["chunk_bytes"]), [(str(f["file"]), int(f["bytes"])) for f in data["layers"]],
                            experts, str(data["non_experts"]["sha256"]), dict(data.get("tied", {})),
                            data.get("max_position_embeddings"), data.get("expert_dtype"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PackError(f"{path}: not a valid pack manifest ({type(exc).__name__}: {exc})") from None
    expected = {(l, e) for l in range(manifest.num_layers) for e in range(manifest.num_experts)}
    if set(experts) != expected or len(manifest.layer_files) != manifest.num_layers:
        absent = sorted(expected - set(experts))
        raise PackError(f"{path}: lists {len(experts)} experts in {len(manifest.layer_files)} layer files, expected "
                        f"{len(expected)} in {manifest.num_layers}"
                        + (f" (no entry for layer {absent[0][0]} expert {absent[0][1]})" if absent else ""))
    check_layout(manifest, path, PackError)
    chunks = len(manifest.chunks())
    if any(len(e.sha256) != chunks or len(e.xxh3) != chunks for e in experts.values()):
        raise PackError(f"{path}: the chunk checksums do not cover the {manifest.expert_bytes} bytes of each expert")
    return manifest


def load_skeleton(manifest: Manifest, device="cpu", dtype=None, verify: bool = True):
    """The model with every non-expert weight loaded and no expert weight at all (the fused expert tensors
    are empty): (model, adapter, seconds). Expert weights come from an ExpertSource at run time."""
    import torch
    import transformers
    from safetensors.torch import load_file

    from moe_offload.models.adapters import MoeAdapter, architecture_of, read_config

    started = time.perf_counter()
    config = read_config(manifest.directory)
    spec = architecture_of(config)
    config._experts_implementation = "eager"
    with torch.device("meta"):
        model = getattr(transformers, spec.causal_lm)(config)
    adapter = MoeAdapter(model, stored_dtype=manifest.dtype)
    if adapter.decoder_layers != manifest.decoder_layers or adapter.num_experts != manifest.num_experts:
        raise PackError(f"{manifest.directory}: config.json and the manifest disagree on the MoE layers")
    file = manifest.directory / NON_EXPERTS
    _check_shapes(model, adapter, manifest, file)  # before any memory is allocated for them
    for layer in range(adapter.num_layers):
        module = adapter.experts(layer)
        for name in adapter.EXPERT_TENSORS:  # no storage: the weights live in the tiers
            setattr(module, name, torch.nn.Parameter(torch.empty(0, device=device), requires_grad=False))
    model.to_empty(device=device)
    if verify and file_sha256(file) != manifest.non_experts_sha256:
        raise PackError(f"{file}: checksum mismatch with the manifest (corrupt or replaced)")
    try:
        state = load_file(file, device=str(device))
    except Exception as exc:  # safetensors raises its own SafetensorError for a corrupt header
        raise PackError(f"{file}: cannot be read: {exc}") from None
    expert_names = expert_parameter_names(adapter)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = set(missing) - expert_names - set(manifest.tied)
    if missing or unexpected:
        problem = f"lacks {sorted(missing)[0]}" if missing else f"has unexpected {sorted(unexpected)[0]}"
        raise PackError(f"{file}: {problem}")
    # Non-persistent buffers (rotary frequencies) are in no file: computed again as from_pretrained computes
    # them, in the dtype the model's code gives them (float32 for rotary frequencies, whatever the weights'
    # dtype); casting them with the weights would change the float16 model's rotations, and its tokens.
    with_buffers = [(module, {name: module._buffers[name].dtype for name in module._non_persistent_buffers_set})
                    for module in model.modules() if getattr(module, "_non_persistent_buffers_set", None)]
    model.to(dtype=dtype or getattr(torch, manifest.dtype))
    with torch.no_grad():
        for name, target in manifest.tied.items():
            model.get_parameter(name).copy_(model.get_parameter(target))
        for module, dtypes in with_buffers:
            for name, buffer_dtype in dtypes.items():
                module._buffers[name] = module._buffers[name].to(buffer_dtype)
            model._init_weights(module)
    return model.eval(), adapter, time.perf_counter() - started


def _check_shapes(model, adapter, manifest: Manifest, file: Path) -> None:
    """PackError unless the model that config.json describes (``model``, on the meta device) has the shapes of
    the manifest's expert tensors and of every tensor in the non-expert file: a hand-edited ``vocab_size`` or
    tensor shape is refused naming the tensor, instead of failing deep in PyTorch (or allocating a vocabulary
    of 10^12 rows)."""
    from safetensors import SafetensorError, safe_open

    expected = {name: tuple(getattr(adapter.experts(0), name).shape[1:]) for name in adapter.EXPERT_TENSORS}
    for tensor in manifest.tensors:
        if expected.get(tensor.name) != tensor.shape:
            raise PackError(f"{manifest.directory / MANIFEST}: expert tensor {tensor.name} has shape "
                            f"{list(tensor.shape)}, config.json gives the model {list(expected.get(tensor.name, ()))}")
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    try:
        with safe_open(file, "pt") as handle:
            for name in handle.keys():
                stored = tuple(handle.get_slice(name).get_shape())
                if name in shapes and stored != shapes[name]:
                    raise PackError(f"{file}: {name} has shape {list(stored)}, config.json gives the model "
                                    f"{list(shapes[name])}")
    except (SafetensorError, OSError) as exc:
        raise PackError(f"{file}: cannot be read: {exc}") from None


def model_files(name: str) -> list[Path]:
    """Every file of the model ``--model NAME`` names (a packed directory, or a checkpoint and its packed
    copies in the cache): inputs of the command that runs it, which none of its outputs may overwrite
    (outputs.check_output)."""
    from moe_offload.models.tiny import model_directory

    directory = model_directory(name)
    if directory.is_file():  # a GGUF file (models/gguf.py)
        return [directory]
    if not directory.is_dir():
        return []
    folders = [directory]
    if missing(directory / MANIFEST):  # a checkpoint: its packs in the cache too (packed_directory's names)
        folders += sorted((cache_root() / "packed").glob(f"{glob.escape(directory.resolve().name)}-*"))
    return [path for folder in folders for path in folder.rglob("*") if path.is_file()]


def cache_root() -> Path:
    """Where packed copies of models are kept: $MOE_OFFLOAD_CACHE, else $XDG_CACHE_HOME/moe-offload."""
    import os

    if os.environ.get("MOE_OFFLOAD_CACHE"):
        return Path(os.environ["MOE_OFFLOAD_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe-offload"


def packed_directory(name: str, on_expert=None, expert_dtype: str | None = None) -> Path:
    """``--model NAME`` for the runtime: a packed directory as is; ``tiny`` or a checkpoint directory packed
    once into the cache, in a directory named after its weights' checksum so that a retrained or replaced
    checkpoint is packed anew instead of serving a stale pack; a hub id (models/hub.py) packed once per
    repository and commit; a GGUF file (models/gguf.py) once per its SHA-256 or hub commit. Each ``expert_dtype``
    (None: the checkpoint's) has its own pack."""
    check_expert_dtype(expert_dtype)
    from moe_offload.models.gguf import gguf_path, is_gguf, pack_key
    from moe_offload.models.hub import hub_id, resolve
    from moe_offload.models.tiny import model_directory

    if is_gguf(name):
        path, commit = gguf_path(name)
        return _packed_once(path, pack_key(name, path, commit), on_expert, expert_dtype)

    if hub_id(name) is not None:  # a hub snapshot: its commit pins its files, no need to hash them
        hub = resolve(name)
        return _packed_once(hub.directory, f"{hub.repo_id.replace('/', '--')}-{hub.commit[:12]}", on_expert,
                            expert_dtype)
    directory = model_directory(name)
    if not directory.exists():
        raise ConfigError(f"{directory}: no such model directory")
    if not directory.is_dir():
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
    import sys
    import tempfile

    from moe_offload.runtime.cpu_threads import single_threaded

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
