"""Counts-only routing: how many times each expert of each layer was requested, without the order.

SGLang's expert-distribution recorder (``--expert-distribution-recorder-mode stat``, then
``/dump_expert_distribution_record``) writes ``expert_distribution_recorder_<time>.pt``: a dict whose
``logical_count`` is an int32 tensor ``[buffered steps, layers, logical experts]``
(``python/sglang/srt/eplb/expert_distribution.py``, ``_StatAccumulator.dump``); EPLB balancers take the same
``[layers, experts]`` load table (DeepSeek's ``eplb.rebalance_experts(weight, ...)``); and any tool can write
a plain table. No cache can be replayed from counts (a cache's hits depend on the order), but the static
questions have their answers here:

* :meth:`ExpertCounts.frequency_coverage`: the share of all expert requests a frequency placement of C
  experts serves, for each budget C: the sum of the C largest counts over the total. It is what the
  ``static-freq`` policy in hindsight serves on the trace the counts came from (policies/static_freq.py:
  "the hits are the sum of the C largest n_k"), so a table counted from a trace gives exactly that trace's
  number (tests/test_counts.py checks it against the replay).
* :meth:`ExpertCounts.layer_skew`: per layer, the share of its requests its most requested expert takes,
  and the normalised entropy of its counts (1 = uniform, 0 = one expert takes everything).
* :meth:`ExpertCounts.placement` and :meth:`ExpertCounts.host_layers`: the experts a frequency placement of
  C experts keeps in fast memory, and the layers of which it keeps none (every expert of those layers runs
  where it lives: keep them on the host).

Files :func:`read_counts` reads, by suffix:

* ``.csv``: a wide table, one line per layer of its J counts (an optional header line whose first cell is
  not a number, and then an optional leading ``layer`` column), or the long form with header
  ``layer,expert,count``;
* ``.json``: ``[[...], ...]`` (layers x experts), or an object with ``counts`` or ``logical_count``;
* ``.npy``: ``[layers, experts]`` or ``[steps, layers, experts]`` (summed over steps); a routing array
  ``[tokens, layers, top_k]`` of the same rank is told apart and refused with the command that imports it
  (``_reads_as_routing``);
* ``.pt``: SGLang's dump (``logical_count``, summed over the buffered steps); needs PyTorch, read with
  ``weights_only=True`` (no code in the file runs).

Counts are finite non-negative numbers (EPLB loads may be fractional); a layer of zeros is a layer no token
reached (a dense layer in SGLang's table). A ``.csv`` with the header of a routing log ``trace import`` reads
(the generic CSV's, llama-moe-trace's) is refused with the command that imports it: it holds the order.
"""

from __future__ import annotations

import csv
import io
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_offload.errors import ConfigError, TraceError
from moe_offload.inputs import check_input, parse_json, read_text
from moe_offload.trace.format import MAX_EXPERT_SLOTS, Trace, json_import_command
from moe_offload.trace.importers.arrays import read_npy_file
from moe_offload.trace.importers.tools import CSV_HEADERS, LLAMACPP_FORK_HEADER

COUNTS_SUFFIXES = (".csv", ".json", ".npy", ".pt")
# A counts file larger than this is no count table (a DeepSeek-V3 table is 61 x 256 numbers).
MAX_COUNTS_FILE_BYTES = 256 * 2**20
# The headers of the routing CSVs `trace import` reads, and its format for each: such a file has an order to
# replay, and read as a wide table of counts it would give numbers of nothing.
ROUTING_CSV_HEADERS = {**{tuple(header): "csv FILE --experts J" for header in CSV_HEADERS},
                       ("layer", "expert"): "llamacpp FILE --model-config config.json",
                       tuple(LLAMACPP_FORK_HEADER): "llamacpp FILE --model-config config.json"}


@dataclass(frozen=True)
class LayerSkew:
    layer: int
    requests: float
    top_share: float        # the most requested expert's share of the layer's requests
    entropy_ratio: float    # entropy of the counts over log J: 1 uniform, 0 a single expert


@dataclass(frozen=True)
class ExpertCounts:
    """Expert requests per layer and expert, ``counts[l, j]`` (a token selecting expert j in layer l is one)."""

    counts: np.ndarray  # [L, J] float64
    source: str = ""

    @classmethod
    def of_trace(cls, trace: Trace) -> "ExpertCounts":
        """The counts of a full trace: what a counting recorder would have written for it."""
        L, J = trace.meta.num_layers, trace.meta.num_experts
        keys = (trace.experts.astype(np.int64) + np.arange(L, dtype=np.int64)[None, :, None] * J).reshape(-1)
        counts = np.bincount(keys, minlength=L * J).reshape(L, J).astype(np.float64)
        return cls(counts, f"counted from {trace.path}")

    @property
    def num_layers(self) -> int:
        return int(self.counts.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[1])

    @property
    def num_expert_slots(self) -> int:
        return self.counts.size

    @property
    def total(self) -> float:
        return float(self.counts.sum())

    def frequency_coverage(self, budgets) -> list[float]:
        """For each budget C (experts), the share of all requests the C most requested experts serve."""
        ranked = np.cumsum(np.sort(self.counts.reshape(-1))[::-1])
        total = ranked[-1] if ranked.size else 0.0
        shares = []
        for budget in budgets:
            budget = min(int(budget), ranked.size)
            shares.append(float(ranked[budget - 1] / total) if budget > 0 and total > 0 else 0.0)
        return shares

    def placement(self, budget: int) -> np.ndarray:
        """[L, J] bool: the experts a frequency placement of ``budget`` experts keeps (ties: the lower layer,
        then the lower expert, as static-freq ranks them)."""
        flat = self.counts.reshape(-1)
        chosen = np.argsort(-flat, kind="stable")[:max(0, min(int(budget), flat.size))]
        kept = np.zeros(flat.size, bool)
        kept[chosen] = True
        return kept.reshape(self.counts.shape)

    def host_layers(self, budget: int) -> list[int]:
        """The layers of which a frequency placement of ``budget`` experts keeps no expert."""
        return np.flatnonzero(~self.placement(budget).any(axis=1)).tolist()

    def layer_skew(self) -> list[LayerSkew]:
        result = []
        for layer, row in enumerate(self.counts):
            total = float(row.sum())
            if total == 0:
                result.append(LayerSkew(layer, 0.0, 0.0, 0.0))
                continue
            p = row[row > 0] / total
            entropy = float(-(p * np.log(p)).sum())
            result.append(LayerSkew(layer, total, float(row.max() / total),
                                    entropy / math.log(self.num_experts) if self.num_experts > 1 else 0.0))
        return result


def is_counts_file(path) -> bool:
    """Whether ``path`` names a counts table (by its suffix) rather than a trace."""
    return Path(str(path)).suffix.lower() in COUNTS_SUFFIXES


def read_counts(path) -> ExpertCounts:
    """The :class:`ExpertCounts` of a counts file; TraceError naming the file (and line) and the problem."""
    path = check_input(path, "expert counts table", TraceError)
    size = path.stat().st_size
    if size > MAX_COUNTS_FILE_BYTES:
        raise TraceError(path, f"{size:,} bytes is no table of expert counts (at most {MAX_COUNTS_FILE_BYTES:,})")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        counts = _csv_counts(path)
    elif suffix == ".json":
        counts = _json_counts(path)
    elif suffix == ".npy":
        counts = read_npy_file(path, MAX_COUNTS_FILE_BYTES)
        if _reads_as_routing(counts):
            tokens, layers, top_k = counts.shape
            raise TraceError(path, f"an integer array [{tokens}, {layers}, {top_k}] whose every row holds {top_k} "
                                   "different values, summing differently across the layers of a step, is routing "
                                   "(the experts each token chose), not counts [steps, layers, experts]: import it "
                                   f"with `moe-offload trace import npy {shlex.quote(str(path))} --experts J "
                                   "-o TRACE.parquet`")
    elif suffix == ".pt":
        counts = _sglang_dump(path)
    else:
        raise TraceError(path, f"a counts table is {', '.join(COUNTS_SUFFIXES)}, not {suffix or 'no suffix'}")
    return ExpertCounts(_checked(np.asarray(counts), path), f"counts from {path.name}")


def _reads_as_routing(array: np.ndarray) -> bool:
    """Whether a ``.npy`` array is a routing array [tokens, layers, top_k] of expert ids rather than counts
    [steps, layers, experts]. The two have the same rank; they differ in two ways. A token chooses top_k
    different experts at a layer, so every row of a routing array holds distinct values, where counts repeat
    (zeros, ones). And every token is routed at every MoE layer, so a step's counts sum to its tokens x top_k at
    each layer that routed any, where a routing array's rows sum to whatever ids were chosen. Both must point to
    routing: a counts table whose rows happen to be distinct still sums alike across its layers."""
    if array.ndim != 3 or not np.issubdtype(array.dtype, np.integer) or array.shape[0] * array.shape[1] < 2:
        return False
    ordered = np.sort(array, axis=2)
    if (np.diff(ordered, axis=2) == 0).any():
        return False
    sums = array.sum(axis=2, dtype=np.int64)
    for step in sums:
        routed = step[step != 0]
        if routed.size > 1 and (routed != routed[0]).any():
            return True
    return False


def _checked(counts: np.ndarray, path: Path) -> np.ndarray:
    if counts.dtype == bool or not np.issubdtype(counts.dtype, np.number):
        raise TraceError(path, f"counts must be numbers, not {counts.dtype}")
    if counts.ndim == 3:  # [steps, layers, experts]
        counts = counts.sum(axis=0, dtype=np.float64)
    if counts.ndim != 2 or 0 in counts.shape:
        raise TraceError(path, f"counts of shape {list(counts.shape)} are not [layers, experts]")
    if counts.size > MAX_EXPERT_SLOTS:
        raise TraceError(path, f"{counts.shape[0]} layers x {counts.shape[1]} experts, more than the "
                               f"{MAX_EXPERT_SLOTS:,} this release handles")
    counts = counts.astype(np.float64)
    bad = ~np.isfinite(counts) | (counts < 0)
    if bad.any():
        layer, expert = (int(i) for i in np.argwhere(bad)[0])
        raise TraceError(path, f"layer {layer} expert {expert}: count {counts[layer, expert]} is not a finite "
                               "non-negative number")
    if counts.sum() == 0:
        raise TraceError(path, "every count is 0: no expert was requested")
    return counts


def _number(text: str, path: Path, line: int) -> float:
    try:
        return float(text)
    except ValueError:
        raise TraceError(path, f"{text.strip()[:60]!r} is not a count", row=line, unit="line") from None


def _csv_counts(path: Path) -> np.ndarray:
    rows = [row for row in csv.reader(io.StringIO(read_text(path, "expert counts table", TraceError), newline=""))]
    numbered = [(line, row) for line, row in enumerate(rows, start=1) if row and any(c.strip() for c in row)]
    if not numbered:
        raise TraceError(path, "no counts (the file is empty)")
    header = [c.strip().lower() for c in numbered[0][1]]
    routing = ROUTING_CSV_HEADERS.get(tuple(header))
    if routing is not None:
        command = f"moe-offload trace import {routing.replace('FILE', shlex.quote(str(path)))} -o TRACE.parquet"
        raise TraceError(path, f"a routing log (header {','.join(header)}), not a counts table: convert it with "
                               f"`{command}` and give that trace, which keeps the order the counts lose")
    if header == ["layer", "expert", "count"]:
        cells = {}
        for line, row in numbered[1:]:
            if len(row) != 3:
                raise TraceError(path, f"{len(row)} columns, the header has 3", row=line, unit="line")
            layer, expert, count = (_number(c, path, line) for c in row)
            if not (layer.is_integer() and expert.is_integer() and 0 <= layer < 2**16 and 0 <= expert < 2**24):
                raise TraceError(path, "layer and expert must be whole numbers (layer < 65,536, expert < 2**24)",
                                 row=line, unit="line")
            cells[(int(layer), int(expert))] = cells.get((int(layer), int(expert)), 0.0) + count
        if not cells:
            raise TraceError(path, "no counts (only a header)")
        shape = (max(l for l, _ in cells) + 1, max(e for _, e in cells) + 1)
        if shape[0] * shape[1] > MAX_EXPERT_SLOTS:
            raise TraceError(path, f"{shape[0]} layers x {shape[1]} experts, more than the {MAX_EXPERT_SLOTS:,} this "
                                   "release handles")
        counts = np.zeros(shape)
        for (layer, expert), count in cells.items():
            counts[layer, expert] = count
        return counts
    body, layer_column = numbered, False
    try:
        float(numbered[0][1][0])
    except ValueError:  # a header line
        body, layer_column = numbered[1:], header[0] == "layer"
    table = [[_number(c, path, line) for c in (row[1:] if layer_column else row)] for line, row in body]
    if not table:
        raise TraceError(path, "no counts (only a header)")
    width = len(table[0])
    for (line, _), values in zip(body, table):
        if len(values) != width:
            raise TraceError(path, f"{len(values)} counts, the first layer has {width}", row=line, unit="line")
    return np.asarray(table)


def _json_counts(path: Path) -> np.ndarray:
    text = read_text(path, "expert counts table", TraceError)
    document = parse_json(text, path, "expert counts table", TraceError)
    if isinstance(document, dict):
        key = next((k for k in ("counts", "logical_count") if k in document), None)
        if key is None:
            keys = ", ".join(repr(k) for k in list(document)[:4]) or "no key"
            raise TraceError(path, f"a counts object holds 'counts' or 'logical_count', and this one has {keys}: a "
                                   f"routing log is converted with {json_import_command(path, text.encode())}")
        document = document[key]
    if not (isinstance(document, list) and document and all(isinstance(r, list) and r for r in document)):
        raise TraceError(path, "counts must be a list of per-layer lists of numbers")
    try:
        return np.asarray(document, dtype=np.float64)
    except (ValueError, TypeError, OverflowError):
        raise TraceError(path, "counts must be a rectangular table of numbers, one row per layer") from None


def _sglang_dump(path: Path) -> np.ndarray:
    try:
        import torch  # optional: only SGLang's dumps need it
    except ImportError:
        raise ConfigError(f"{path}: reading SGLang's .pt dump needs PyTorch (pip install torch), or save its "
                          "logical_count as .npy") from None
    try:
        dump = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises anything from a damaged file: one line, never a traceback
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise TraceError(path, f"not a readable PyTorch file ({first})") from None
    if not (isinstance(dump, dict) and isinstance(dump.get("logical_count"), torch.Tensor)):
        raise TraceError(path, "not SGLang's expert-distribution dump (a dict with a logical_count tensor; record "
                               "with --expert-distribution-recorder-mode stat)")
    return dump["logical_count"].to(torch.float64).numpy()
