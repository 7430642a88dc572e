"""The model file of the learned eviction policy (paper 003, FlashMoE) and its NumPy forward pass.

A model file is an uncompressed ``.npz`` read with ``allow_pickle=False``. It holds

* ``w1, b1, ..., wN, bN``: the N linear layers of ``networks`` feed-forward networks of the same shape,
  stacked: ``w`` is [networks, out, in] and ``b`` is [networks, out] (PyTorch's layout per network),
  float32 little-endian, SiLU between layers, none after the last. One network scores every expert; with
  ``per_layer`` (paper 003's "per-layer ML cache FFN") network l scores the experts of MoE layer l;
* ``metadata``: a 0-d unicode array holding JSON with
    - ``format`` (``moe-offload.learned-eviction``) and ``format_version`` (an int, 2 here);
    - ``features``: the input definition (``names`` must be ``inv_recency, freq_over_max``, see ``features``);
    - ``architecture``: ``layers`` (the widths, input first: [2, 128, 128, 1] for the paper's network),
      ``activation`` (``silu``), ``networks`` and ``per_layer``;
    - ``weights_sha256``: SHA-256 of the weights (``weights_digest`` defines the bytes hashed);
    - ``target``: what the score predicts (``kind``, a member of ``TARGETS``; higher always means a later
      next use) and ``training``: how the weights were made (traces with their rows and SHA-256, cache
      sizes, seed, epochs, validation loss, held-out misses, torch version); informative, not checked.

Version 1 files (one network whose target was the next-use distance capped at two tokens) are refused
with the command that retrains them: that target could not rank the experts a larger cache keeps.

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
from threadpoolctl import ThreadpoolController

from moe_offload.errors import ConfigError
from moe_offload import inputs
from moe_offload.inputs import check_input, parse_json
from moe_offload.outputs import atomic_output

FORMAT_NAME = "moe-offload.learned-eviction"
FORMAT_VERSION = 2
RETRAIN = ("retrain it with `moe-offload train-eviction` (src/moe_offload/data/NOTICE.md has the command of the "
           "shipped model)")
# What a network's score predicts for a resident expert at an eviction of Belady's OPT; higher = used later.
TARGETS = {
    "rank": "its rank among the residents by next use, 0 (the next used) to 1 (the furthest, Belady's victim)",
    "log-distance": "ln(d / (L*K)), d the requests until its next use (in tokens' worth of requests)",
}
FEATURE_NAMES = ("inv_recency", "freq_over_max")
FEATURE_DEFINITION = (
    "per cached expert, at the current token (time step): inv_recency = 1/r where r = tokens since the "
    "expert was last routed + 1 (r = 1 when routed in the current token; 0 if never routed); "
    "freq_over_max = f / max f, f = tokens in which the expert was routed so far (kept across evictions), "
    "max f = the largest f of any expert so far (0 when max f is 0)")
ACTIVATION = "silu"
WEIGHT_DTYPE = np.dtype("<f4")
# The BLAS libraries NumPy loaded, whose threads a forward pass limits to one: OpenBLAS splits a product of 64
# rows or more over its threads, which changes float32 scores in their last bits (so the victims of near ties,
# and every number after them, would depend on the machine's cores) and, at these sizes (a few hundred rows of
# 128 columns), costs more than it saves: 4.6 ms a 200-row pass on 2 threads against 0.3 ms on one, measured on
# a loaded 2-core machine, where the idle threads' spinning took half the CPU of `report`.
_BLAS = ThreadpoolController()


def features(recency: np.ndarray, freq: np.ndarray, max_freq: int) -> np.ndarray:
    """The network's [N, 2] float32 input from integer recency r (0 = never routed) and frequency f."""
    recency = np.asarray(recency, dtype=np.float64)
    out = np.empty((recency.shape[0], 2), dtype=np.float32)
    with np.errstate(divide="ignore"):
        out[:, 0] = np.where(recency > 0, 1.0 / np.maximum(recency, 1.0), 0.0)
    out[:, 1] = np.asarray(freq, dtype=np.float64) / max_freq if max_freq > 0 else 0.0
    return out


# The grid the policy reads its network on (policies/learned.py derives it): row r is recency r for
# r <= GRID_RECENCY (row 0: never routed), and farther recencies fall in GRID_FAR bins of equal width in 1/r
# below 1/GRID_RECENCY; column c is f / max f rounded to c / GRID_FREQUENCY.
GRID_RECENCY = 128
GRID_FAR = 128
GRID_FREQUENCY = 1024
GRID_ROWS = 1 + GRID_RECENCY + GRID_FAR
GRID_COLUMNS = GRID_FREQUENCY + 1
GRID_PIECE = 4096
_TABLES: dict = {}  # weights digest -> score table: every policy built from one model shares its table
_TABLES_KEPT = 4


def grid_row(recency):
    """The grid row of integer recency r (0: never routed), in the subset of Python Numba compiles."""
    if recency <= GRID_RECENCY:
        return recency
    return GRID_RECENCY + 1 + (GRID_RECENCY * GRID_FAR) // recency


def column_scale(max_freq):
    """What ``grid_column`` multiplies f by: GRID_FREQUENCY / max f (0 when max f is 0)."""
    if max_freq <= 0:
        return 0.0
    return GRID_FREQUENCY / max_freq


def grid_column(freq, scale):
    """The grid column of f / max f, the nearest multiple of 1 / GRID_FREQUENCY, from ``column_scale(max f)``
    (one multiplication a resident). The same float64 operations in NumPy, Python and Numba give the same
    column."""
    return int(freq * scale + 0.5)


def grid_rows(recency: np.ndarray) -> np.ndarray:
    """``grid_row`` of every element of an integer array."""
    recency = np.asarray(recency, dtype=np.int64)
    far = GRID_RECENCY + 1 + (GRID_RECENCY * GRID_FAR) // np.maximum(recency, 1)
    return np.where(recency <= GRID_RECENCY, recency, far)


def grid_columns(freq: np.ndarray, max_freq: int) -> np.ndarray:
    """``grid_column`` of every element of an integer array."""
    return np.floor(np.asarray(freq, dtype=np.int64) * column_scale(max_freq) + 0.5).astype(np.int64)


def grid_features() -> np.ndarray:
    """The network's input at every grid point, [GRID_ROWS * GRID_COLUMNS, 2] float32, row-major: 1/r as
    ``features`` computes it for r <= GRID_RECENCY, the middle of its bin in 1/r beyond, and c / GRID_FREQUENCY."""
    inverse = np.zeros(GRID_ROWS)
    inverse[1:GRID_RECENCY + 1] = features(np.arange(1, GRID_RECENCY + 1), np.zeros(GRID_RECENCY), 0)[:, 0]
    inverse[GRID_RECENCY + 1:] = (np.arange(GRID_FAR) + 0.5) / (GRID_RECENCY * GRID_FAR)
    out = np.empty((GRID_ROWS, GRID_COLUMNS, 2), dtype=np.float32)
    out[:, :, 0] = inverse[:, None]
    out[:, :, 1] = (np.arange(GRID_COLUMNS) / GRID_FREQUENCY)[None, :]
    return out.reshape(-1, 2)


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
    """A loaded network, or one per MoE layer: ``layers`` is [(w [networks, out, in], b [networks, out]), ...];
    ``metadata`` the file's JSON."""

    layers: list[tuple[np.ndarray, np.ndarray]]
    metadata: dict = field(default_factory=dict)
    path: str = "<memory>"

    def __post_init__(self):
        if self.layers and np.ndim(self.layers[0][0]) == 2:  # one network given in PyTorch's layout
            self.layers = [(np.asarray(w)[None], np.asarray(b)[None]) for w, b in self.layers]

    @property
    def networks(self) -> int:
        return int(self.layers[0][0].shape[0])

    @property
    def per_layer(self) -> bool:
        return bool((self.metadata.get("architecture") or {}).get("per_layer", self.networks > 1))

    @property
    def widths(self) -> list[int]:
        return [int(self.layers[0][0].shape[2])] + [int(w.shape[1]) for w, _ in self.layers]

    @property
    def flops_per_row(self) -> int:
        """Multiply-adds of one input row through one network, counted as 2 FLOPs each (the biases and SiLU,
        under 2% of it for the paper's 2 -> 128 -> 128 -> 1, are left out): 33,536 for that network."""
        widths = self.widths
        return 2 * sum(a * b for a, b in zip(widths, widths[1:]))

    def rows_trained_on(self, trace_sha256: str) -> list[str]:
        """The row ranges (``START:END``) of the trace file with this SHA-256 that the model was trained on."""
        traces = (self.metadata.get("training") or {}).get("traces") or []
        return [str(t.get("rows", "?")) for t in traces if isinstance(t, dict) and t.get("sha256") == trace_sha256]

    def forward(self, x: np.ndarray, network: np.ndarray | None = None) -> np.ndarray:
        """Scores of the [N, 2] feature rows ``x``: an [N] float32 array. ``network`` gives each row's
        network (the MoE layer of its expert for a per-layer model); None means network 0 for all."""
        x = np.asarray(x, dtype=np.float32)
        with _BLAS.limit(limits=1, user_api="blas"):  # the same scores on any machine (see _BLAS)
            if network is None or self.networks == 1:
                return self._forward_one(x, 0)
            network = np.asarray(network)
            out = np.empty(x.shape[0], dtype=np.float32)
            for index in np.unique(network).tolist():
                rows = network == index
                out[rows] = self._forward_one(x[rows], index)
            return out

    def score_table(self) -> np.ndarray:
        """Every network's score at every grid point, [networks, GRID_ROWS, GRID_COLUMNS] float64 (the float32
        scores, widened), computed once per process for each set of weights (a policy asks when it is built,
        so that its first eviction, which the runtime times as a decision, does not compute it):
        GRID_ROWS * GRID_COLUMNS rows (263,425) through each network, about a third of a second for
        the paper's network on one core, in pieces of GRID_PIECE rows (whose activations stay in the caches:
        the whole grid at once took three times as long, for the same bits). A per-layer model has one table per
        network: at 48 MoE layers 96 MiB and about 9 s."""
        digest = self.metadata.get("weights_sha256") or weights_digest(self.layers)
        table = _TABLES.get(digest)
        if table is None:
            grid = grid_features()
            table = np.empty((self.networks, grid.shape[0]), np.float64)
            for network in range(self.networks):
                for start in range(0, grid.shape[0], GRID_PIECE):
                    rows = grid[start:start + GRID_PIECE]
                    table[network, start:start + rows.shape[0]] = self.forward(
                        rows, np.full(rows.shape[0], network, np.int64))
            table = table.reshape(self.networks, GRID_ROWS, GRID_COLUMNS)
            table.setflags(write=False)
            while len(_TABLES) >= _TABLES_KEPT:
                _TABLES.pop(next(iter(_TABLES)))
            _TABLES[digest] = table
        return table

    def _forward_one(self, h: np.ndarray, index: int) -> np.ndarray:
        last = len(self.layers) - 1
        for depth, (weight, bias) in enumerate(self.layers):
            h = h @ weight[index].T + bias[index]
            if depth < last:
                h = silu(h)
        return h[:, 0]


def _fail(path, problem: str):
    raise ConfigError(f"learned-eviction model {path}: {problem}")


def save_model(path, layers, *, per_layer: bool = False, target: dict | None = None,
               training: dict | None = None) -> Path:
    """Write ``layers`` ([(w, b), ...] with w [networks, out, in] and b [networks, out], or one network's
    [out, in] and [out]) with their metadata; returns the path. ``target["kind"]`` must be one of TARGETS."""
    path = Path(path)
    layers = [(np.ascontiguousarray(w, dtype=WEIGHT_DTYPE), np.ascontiguousarray(b, dtype=WEIGHT_DTYPE))
              for w, b in LearnedModel(layers).layers]
    target = dict(target or {})
    target.setdefault("kind", "rank")
    if target["kind"] not in TARGETS:
        raise ConfigError(f"unknown learned-eviction target {target['kind']!r}; choose from {', '.join(TARGETS)}")
    target.setdefault("definition", TARGETS[target["kind"]])
    networks = int(layers[0][0].shape[0])
    widths = [int(layers[0][0].shape[2])] + [int(w.shape[1]) for w, _ in layers]
    metadata = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "features": {"names": list(FEATURE_NAMES), "definition": FEATURE_DEFINITION},
        "architecture": {"type": "feed-forward", "layers": widths, "activation": ACTIVATION,
                         "networks": networks, "per_layer": bool(per_layer),
                         "output": "the cached expert with the highest score is evicted"},
        "weights_sha256": weights_digest(layers),
        "target": target,
        "training": training or {},
    }
    _check_layers(path, layers, widths, networks)
    arrays = {"metadata": np.array(json.dumps(metadata, sort_keys=True))}
    for index, (weight, bias) in enumerate(layers, start=1):
        arrays[f"w{index}"], arrays[f"b{index}"] = weight, bias
    with atomic_output(path) as temporary, open(temporary, "wb") as out:
        np.savez(out, **arrays)  # a file object: savez adds no .npz to the name
    return path


def _check_layers(path, layers, widths, networks) -> None:
    if len(widths) < 2 or widths[0] != len(FEATURE_NAMES) or widths[-1] != 1:
        _fail(path, f"architecture layers {widths} must start with {len(FEATURE_NAMES)} inputs and end with 1 "
                    "output")
    for index, (weight, bias) in enumerate(layers, start=1):
        want_w, want_b = (networks, widths[index], widths[index - 1]), (networks, widths[index])
        if weight.shape != want_w:
            _fail(path, f"w{index} has shape {weight.shape}, {networks} network(s) of layers {widths} need {want_w}")
        if bias.shape != want_b:
            _fail(path, f"b{index} has shape {bias.shape}, {networks} network(s) of layers {widths} need {want_b}")
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
    if version < FORMAT_VERSION:
        _fail(path, f"format version {version} predicts a next-use distance capped at two tokens, which cannot "
                    f"rank the experts a large cache keeps; this release reads version {FORMAT_VERSION}: {RETRAIN}")
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
    networks = arch.get("networks")
    if not isinstance(networks, int) or isinstance(networks, bool) or networks < 1:
        _fail(path, f"architecture networks must be a positive integer, got {networks!r}")
    if not isinstance(arch.get("per_layer"), bool) or (networks > 1 and not arch["per_layer"]):
        _fail(path, f"architecture per_layer must be true or false (true when there are several networks), got "
                    f"{arch.get('per_layer')!r}")
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
    _check_layers(path, layers, widths, networks)
    digest = weights_digest(layers)
    if meta.get("weights_sha256") != digest:
        _fail(path, f"weights checksum mismatch (metadata says {meta.get('weights_sha256')!r}, the weights hash "
                    f"to {digest!r}): the file is corrupt or was edited")
    return LearnedModel(layers=layers, metadata=meta, path=str(path))
