"""The model file of the learned eviction policy (paper 003, FlashMoE) and its NumPy forward pass.

A model file is an uncompressed ``.npz`` read with ``allow_pickle=False``. It holds

* ``w1, b1, ..., wN, bN``: the N linear layers of a feed-forward network in PyTorch's layout
  (``w`` is [out, in], ``b`` is [out]), float32 little-endian, SiLU between layers, none after the last;
* ``metadata``: a 0-d unicode array holding JSON with
    - ``format`` (``moe-offload.learned-eviction``) and ``format_version`` (an int, 1 here);
    - ``features``: the input definition (``names`` must be ``inv_recency, freq_over_max``, see ``features``);
    - ``architecture``: ``layers`` (the widths, input first: [2, 128, 128, 1] for the paper's network) and
      ``activation`` (``silu``);
    - ``weights_sha256``: SHA-256 of the weights (``weights_digest`` defines the bytes hashed);
    - ``target`` and ``training``: how the weights were made (trace, rows, cache sizes, seed, epochs,
      validation loss, torch version); informative, not checked.

``load_model`` checks all of it and raises ConfigError naming the file and the problem; nothing else
escapes it. The policy (moe_offload.policies.learned) and the trainer (moe_offload.training) share
``features`` so that the network sees the same numbers in both.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload import inputs
from moe_offload.inputs import check_input, parse_json
from moe_offload.outputs import atomic_output

FORMAT_NAME = "moe-offload.learned-eviction"
FORMAT_VERSION = 1
FEATURE_NAMES = ("inv_recency", "freq_over_max")
FEATURE_DEFINITION = (
    "per cached expert, at the current token (time step): inv_recency = 1/r where r = tokens since the "
    "expert was last routed + 1 (r = 1 when routed in the current token; 0 if never routed); "
    "freq_over_max = f / max f, f = tokens in which the expert was routed so far (kept across evictions), "
    "max f = the largest f of any expert so far (0 when max f is 0)")
ACTIVATION = "silu"
WEIGHT_DTYPE = np.dtype("<f4")


def features(recency: np.ndarray, freq: np.ndarray, max_freq: int) -> np.ndarray:
    """The network's [N, 2] float32 input from integer recency r (0 = never routed) and frequency f."""
    recency = np.asarray(recency, dtype=np.float64)
    out = np.empty((recency.shape[0], 2), dtype=np.float32)
    with np.errstate(divide="ignore"):
        out[:, 0] = np.where(recency > 0, 1.0 / np.maximum(recency, 1.0), 0.0)
    out[:, 1] = np.asarray(freq, dtype=np.float64) / max_freq if max_freq > 0 else 0.0
    return out


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), written with tanh so that no value overflows."""
    return x * (0.5 + 0.5 * np.tanh(0.5 * x))


def weights_digest(layers: list[tuple[np.ndarray, np.ndarray]]) -> str:
    """SHA-256 over, for each array in the order w1, b1, w2, b2, ...: a header line
    ``name:dtype:shape`` then the array's C-order bytes."""
    digest = hashlib.sha256()
    for index, (weight, bias) in enumerate(layers, start=1):
        for name, array in ((f"w{index}", weight), (f"b{index}", bias)):
            array = np.ascontiguousarray(array, dtype=WEIGHT_DTYPE)
            digest.update(f"{name}:{array.dtype.str}:{'x'.join(map(str, array.shape))}\n".encode())
            digest.update(array.tobytes())
    return digest.hexdigest()


@dataclass
class LearnedModel:
    """A loaded network: ``layers`` is [(w [out, in], b [out]), ...]; ``metadata`` the file's JSON."""

    layers: list[tuple[np.ndarray, np.ndarray]]
    metadata: dict = field(default_factory=dict)
    path: str = "<memory>"

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Scores ("routing distances") of the [N, 2] feature rows ``x``: an [N] float32 array."""
        h = np.asarray(x, dtype=np.float32)
        last = len(self.layers) - 1
        for index, (weight, bias) in enumerate(self.layers):
            h = h @ weight.T + bias
            if index < last:
                h = silu(h)
        return h[:, 0]

    @property
    def widths(self) -> list[int]:
        return [int(self.layers[0][0].shape[1])] + [int(w.shape[0]) for w, _ in self.layers]


def _fail(path, problem: str):
    raise ConfigError(f"learned-eviction model {path}: {problem}")


def save_model(path, layers, *, target: dict | None = None, training: dict | None = None) -> Path:
    """Write ``layers`` ([(w, b), ...], any float arrays) with their metadata; returns the path."""
    path = Path(path)
    layers = [(np.ascontiguousarray(w, dtype=WEIGHT_DTYPE), np.ascontiguousarray(b, dtype=WEIGHT_DTYPE))
              for w, b in layers]
    widths = [int(layers[0][0].shape[1])] + [int(w.shape[0]) for w, _ in layers]
    metadata = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "features": {"names": list(FEATURE_NAMES), "definition": FEATURE_DEFINITION},
        "architecture": {"type": "feed-forward", "layers": widths, "activation": ACTIVATION,
                         "output": "routing distance; the cached expert with the highest score is evicted"},
        "weights_sha256": weights_digest(layers),
        "target": target or {},
        "training": training or {},
    }
    _check_layers(path, layers, widths)
    arrays = {"metadata": np.array(json.dumps(metadata, sort_keys=True))}
    for index, (weight, bias) in enumerate(layers, start=1):
        arrays[f"w{index}"], arrays[f"b{index}"] = weight, bias
    with atomic_output(path) as temporary, open(temporary, "wb") as out:
        np.savez(out, **arrays)  # a file object: savez adds no .npz to the name
    return path


def _check_layers(path, layers, widths) -> None:
    if len(widths) < 2 or widths[0] != len(FEATURE_NAMES) or widths[-1] != 1:
        _fail(path, f"architecture layers {widths} must start with {len(FEATURE_NAMES)} inputs and end with 1 "
                    "output")
    for index, (weight, bias) in enumerate(layers, start=1):
        want_w, want_b = (widths[index], widths[index - 1]), (widths[index],)
        if weight.shape != want_w:
            _fail(path, f"w{index} has shape {weight.shape}, the architecture {widths} needs {want_w}")
        if bias.shape != want_b:
            _fail(path, f"b{index} has shape {bias.shape}, the architecture {widths} needs {want_b}")
        if not (np.isfinite(weight).all() and np.isfinite(bias).all()):
            _fail(path, f"layer {index} holds NaN or infinite weights")


def load_model(path) -> LearnedModel:
    """Read and check a model file; every problem raises ConfigError naming ``path``."""
    path = Path(path)
    if inputs.missing(path):
        _fail(path, "no such file (train one with `moe-offload train-eviction TRACE -o MODEL.npz`)")
    check_input(path, "learned-eviction model", ConfigError)
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, KeyError, MemoryError, zipfile.BadZipFile, zlib.error) as exc:
        _fail(path, f"not a readable .npz model file, corrupt or truncated ({type(exc).__name__}: {exc})")
    if "metadata" not in arrays:
        _fail(path, "no metadata array: not a moe-offload learned-eviction model")
    raw = arrays.pop("metadata")
    if raw.shape != () or raw.dtype.kind != "U":
        _fail(path, "the metadata array is not a JSON string")
    meta = parse_json(str(raw), f"learned-eviction model {path}", "model's metadata")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        _fail(path, f"metadata format is {meta.get('format') if isinstance(meta, dict) else meta!r}, "
                    f"not {FORMAT_NAME!r}")
    version = meta.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        _fail(path, f"format_version {version!r} is not a positive integer")
    if version > FORMAT_VERSION:
        _fail(path, f"format version {version} is newer than this release reads (up to {FORMAT_VERSION}); "
                    "upgrade moe-offload or retrain with this one")
    names = (meta.get("features") or {}).get("names") if isinstance(meta.get("features"), dict) else None
    if names != list(FEATURE_NAMES):
        _fail(path, f"the network expects features {names!r}, this release computes {list(FEATURE_NAMES)}")
    arch = meta.get("architecture")
    if not isinstance(arch, dict) or arch.get("activation") != ACTIVATION:
        _fail(path, f"architecture activation must be {ACTIVATION!r}, got "
                    f"{arch.get('activation') if isinstance(arch, dict) else arch!r}")
    widths = arch.get("layers")
    if (not isinstance(widths, list) or len(widths) < 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in widths)):
        _fail(path, f"architecture layers must be a list of positive widths, got {widths!r}")
    count = len(widths) - 1
    expected = {f"{kind}{i}" for i in range(1, count + 1) for kind in "wb"}
    if set(arrays) != expected:
        missing, extra = sorted(expected - set(arrays)), sorted(set(arrays) - expected)
        _fail(path, "weight arrays do not match the architecture"
                    + (f"; missing {', '.join(missing)}" if missing else "")
                    + (f"; unexpected {', '.join(extra)}" if extra else ""))
    layers = []
    for index in range(1, count + 1):
        weight, bias = arrays[f"w{index}"], arrays[f"b{index}"]
        for name, array in ((f"w{index}", weight), (f"b{index}", bias)):
            if array.dtype != WEIGHT_DTYPE:
                _fail(path, f"{name} has dtype {array.dtype}, expected float32")
        layers.append((weight, bias))
    _check_layers(path, layers, widths)
    digest = weights_digest(layers)
    if meta.get("weights_sha256") != digest:
        _fail(path, f"weights checksum mismatch (metadata says {meta.get('weights_sha256')!r}, the weights hash "
                    f"to {digest!r}): the file is corrupt or was edited")
    return LearnedModel(layers=layers, metadata=meta, path=str(path))
