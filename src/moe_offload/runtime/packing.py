"""Packed checkpoints: the non-expert weights in one file, every routed expert in its own (paper 003, FlashMoE).

``moe-offload pack MODEL -o DIR`` writes::

    DIR/moe-offload-pack.json        the manifest: model, shapes, dtype, every file's size and SHA-256
    DIR/config.json, tokenizer files  copied from MODEL
    DIR/non-experts.safetensors       attention, norms, routers, shared experts, embeddings, LM head
    DIR/experts/layer003/expert005.safetensors   gate_up_proj [2I, H] and down_proj [H, I] of one expert

so that start-up loads only the non-experts (:func:`load_skeleton`) and every expert is read when needed, with
one positional read of one file whose size and checksum the manifest knows.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from moe_offload.errors import ConfigError, MoeOffloadError

MANIFEST = "moe-offload-pack.json"
NON_EXPERTS = "non-experts.safetensors"
FORMAT_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja")


class PackError(MoeOffloadError):
    """A packed model directory is missing a file, or a file does not match the manifest."""


@dataclass(frozen=True)
class ExpertFile:
    layer: int
    expert: int
    path: str     # relative to the pack directory
    nbytes: int   # file size
    sha256: str


@dataclass
class Manifest:
    directory: Path
    model_type: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    dtype: str
    expert_bytes: int  # tensor bytes of one expert in ``dtype``
    decoder_layers: list[int]
    experts: dict[tuple[int, int], ExpertFile]
    non_experts_sha256: str
    tied: dict[str, str]  # parameter -> the parameter it shares storage with (tied embeddings)

    def expert_path(self, layer: int, expert: int) -> Path:
        return self.directory / self.experts[(layer, expert)].path


def expert_parameter_names(adapter) -> set[str]:
    """Qualified names of the fused expert tensors (what the pack moves out of the non-expert file)."""
    names = set()
    for prefix, module in adapter.model.named_modules():
        if any(module is adapter.experts(layer) for layer in range(adapter.num_layers)):
            names.update(f"{prefix}.{tensor}" for tensor in adapter.EXPERT_TENSORS)
    return names


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pack_model(model_dir, out_dir, on_expert=None) -> Manifest:
    """Split the checkpoint in ``model_dir`` into ``out_dir`` (see the module docstring)."""
    import torch
    from safetensors.torch import save_file

    from moe_offload.models.adapters import load_model, read_config

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = read_config(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    stored = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    dtype = getattr(torch, stored, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"{model_dir / 'config.json'}: unknown dtype {stored!r}")
    model, adapter = load_model(model_dir, dtype=dtype)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"{out_dir}: exists and is not empty; pack into a new directory")
    (out_dir / "experts").mkdir(parents=True, exist_ok=True)

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
    save_file(non_experts, out_dir / NON_EXPERTS, metadata={"format": "pt"})

    experts = []
    for layer in range(adapter.num_layers):
        folder = out_dir / "experts" / f"layer{layer:03d}"
        folder.mkdir(exist_ok=True)
        for expert in range(adapter.num_experts):
            path = folder / f"expert{expert:03d}.safetensors"
            save_file({name: t.contiguous() for name, t in adapter.expert_tensors(layer, expert).items()}, path)
            experts.append({"layer": layer, "expert": expert, "file": path.relative_to(out_dir).as_posix(),
                            "bytes": path.stat().st_size, "sha256": _sha256(path)})
            if on_expert:
                on_expert()
    for name in ("config.json", *TOKENIZER_FILES):
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out_dir / name)
    manifest = {
        "format_version": FORMAT_VERSION, "model_type": config.model_type, "source": str(model_dir.resolve()),
        "num_layers": adapter.num_layers, "num_experts": adapter.num_experts, "top_k": adapter.top_k,
        "hidden_size": adapter.hidden_size, "dtype": stored, "expert_bytes": adapter.expert_bytes(),
        "decoder_layers": adapter.decoder_layers, "tied": tied,
        "non_experts": {"file": NON_EXPERTS, "sha256": _sha256(out_dir / NON_EXPERTS)},
        "experts": experts,
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return read_manifest(out_dir)


def read_manifest(directory, check_files: bool = True) -> Manifest:
    """The manifest of a packed directory; with ``check_files``, every expert file must exist with the
    manifest's size (a cheap stat each, so a missing or truncated file is reported at start-up)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise PackError(f"{path}: missing; is {directory} a directory written by `moe-offload pack`?")
    try:
        data = json.loads(path.read_text())
        if data.get("format_version") != FORMAT_VERSION:
            raise PackError(f"{path}: format version {data.get('format_version')!r}, this release reads "
                            f"{FORMAT_VERSION}")
        experts = {}
        for entry in data["experts"]:
            item = ExpertFile(int(entry["layer"]), int(entry["expert"]), str(entry["file"]), int(entry["bytes"]),
                              str(entry["sha256"]))
            experts[(item.layer, item.expert)] = item
        manifest = Manifest(directory, data["model_type"], int(data["num_layers"]), int(data["num_experts"]),
                            int(data["top_k"]), int(data["hidden_size"]), str(data["dtype"]),
                            int(data["expert_bytes"]), [int(i) for i in data["decoder_layers"]], experts,
                            str(data["non_experts"]["sha256"]), dict(data.get("tied", {})))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise PackError(f"{path}: not a valid pack manifest ({type(exc).__name__}: {exc})") from None
    expected = {(l, e) for l in range(manifest.num_layers) for e in range(manifest.num_experts)}
    if set(experts) != expected:
        missing = sorted(expected - set(experts))
        raise PackError(f"{path}: lists {len(experts)} experts, expected {len(expected)}"
                        + (f" (no entry for layer {missing[0][0]} expert {missing[0][1]})" if missing else ""))
    if check_files:
        for item in experts.values():
            file = directory / item.path
            if not file.is_file():
                raise PackError(f"expert {item.expert} of layer {item.layer}: {file}: missing")
            size = file.stat().st_size
            if size != item.nbytes:
                raise PackError(f"expert {item.expert} of layer {item.layer}: {file}: {size} bytes, the manifest "
                                f"says {item.nbytes} (truncated or replaced)")
        if not (directory / NON_EXPERTS).is_file():
            raise PackError(f"{directory / NON_EXPERTS}: missing")
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
    for layer in range(adapter.num_layers):
        module = adapter.experts(layer)
        for name in adapter.EXPERT_TENSORS:  # no storage: the weights live in the tiers
            setattr(module, name, torch.nn.Parameter(torch.empty(0, device=device), requires_grad=False))
    model.to_empty(device=device)
    file = manifest.directory / NON_EXPERTS
    if verify and _sha256(file) != manifest.non_experts_sha256:
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
    with torch.no_grad():
        for name, target in manifest.tied.items():
            model.get_parameter(name).copy_(model.get_parameter(target))
        for module in model.modules():  # non-persistent buffers (rotary frequencies) are not in any file
            if getattr(module, "_non_persistent_buffers_set", None):
                model._init_weights(module)
    model.to(dtype=dtype or getattr(torch, manifest.dtype)).eval()
    return model, adapter, time.perf_counter() - started


def cache_root() -> Path:
    """Where packed copies of models are kept: $MOE_OFFLOAD_CACHE, else $XDG_CACHE_HOME/moe-offload."""
    import os

    if os.environ.get("MOE_OFFLOAD_CACHE"):
        return Path(os.environ["MOE_OFFLOAD_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe-offload"


def packed_directory(name: str, on_expert=None) -> Path:
    """``--model NAME`` for the runtime: a packed directory as is; ``tiny`` or a checkpoint directory packed
    once into the cache, in a directory named after its weights' checksum so that a retrained or replaced
    checkpoint is packed anew instead of serving a stale pack."""
    import sys
    import tempfile

    from moe_offload.models.tiny import model_directory

    directory = model_directory(name)
    if not directory.exists():
        raise ConfigError(f"{directory}: no such model directory")
    if not directory.is_dir():
        raise ConfigError(f"{directory}: not a directory (give a packed model or a checkpoint directory)")
    if (directory / MANIFEST).is_file():
        return directory
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{directory}: not a model: neither a packed model ({MANIFEST}) nor a checkpoint "
                          "(config.json)")
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        raise ConfigError(f"{directory}: no weight file (*.safetensors) in the model directory")
    digest = hashlib.sha256("".join(_sha256(file) for file in weights).encode()).hexdigest()[:12]
    target = cache_root() / "packed" / f"{directory.resolve().name}-{digest}"
    if (target / MANIFEST).is_file():
        return target
    print(f"packing {directory} into {target} (once)", file=sys.stderr)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{target.name}-", dir=target.parent))
    except OSError as exc:
        raise ConfigError(f"{target.parent}: cannot create the pack cache: {exc.strerror or exc}") from None
    try:  # pack aside, then rename: an interrupted pack never looks finished
        pack_model(directory, staging / "packed", on_expert=on_expert)
        try:
            (staging / "packed").rename(target)
        except OSError:
            if not (target / MANIFEST).is_file():  # not just another process that finished first
                raise ConfigError(f"{target}: cannot install the packed model") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
