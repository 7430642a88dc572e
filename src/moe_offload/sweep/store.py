"""A sweep's results file: one Parquet row per finished cell, rewritten atomically as cells finish.

Columns: ``cell`` (the cell's key, sweep/spec.py), ``mode``, ``seed`` and ``options`` (the sweep parameters that
RunResult does not hold), then every RunResult field (trace, policy, cache_size, prefetcher and hardware are
the others): numbers and strings as themselves, lists as Arrow lists, dictionaries (bytes per link,
percentiles, the timeline) as JSON text. The schema metadata ``moe_offload.sweep`` marks the file as a
sweep's, so the command never takes another Parquet file for one (nor writes over it).

The file is sealed as traces are (trace/integrity.py): ``moe_offload.sweep.checksum`` holds a SHA-256 of the
metadata and one of every column as decoded (its values in canonical JSON), so a resumed sweep reads back
exactly the rows that were written, or refuses the file: a flipped bit in a page, a page header or the footer
would otherwise read back as other numbers (an access count of 16,815,488 for 38,272) without a word.

One sweep at a time writes a results file: the store holds an exclusive lock (``flock``) on a lock file
beside it (``.NAME.lock``, left in place: removing it would let a third run lock another file of that name)
from before it reads the file until the sweep ends, and a second sweep with the same output is refused
instead of writing its rows over the first one's. The lock is that of the file the path resolves to (the end
of its symlinks, as outputs.atomic_output writes it), so ``r.parquet`` and ``alias.parquet -> r.parquet``
share one lock.

Why rewrite rather than append: Parquet cannot be appended to, and a file of part files would be the user's
to merge. Every write goes through outputs.atomic_output (a temporary beside the file, fsync, rename), so the
file is always complete: the rows of the cells finished when it was last written (each replay row reported
against Belady's on the same trace, cache size and seed, as `simulate` reports it). The sweep writes it when a
few seconds have passed since the last write (and never spends more than a small share of its time
writing), at the end and when interrupted; a sweep killed outright loses at most the cells of those last
seconds, which the next run does again. Rows are kept in the order of the sweep's cells, so the file does
not depend on which worker finished first.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
import types
import typing
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.inputs import parse_json
from moe_offload.outputs import atomic_output
from moe_offload.results import RunResult
from moe_offload.simulator.grid import set_opt_misses
from moe_offload.sweep.spec import Cell

METADATA_KEY = b"moe_offload.sweep"
CHECKSUM_KEY = b"moe_offload.sweep.checksum"
FORMAT_VERSION = 2  # 2: sealed with CHECKSUM_KEY
SWEEP_COLUMNS = ("cell", "mode", "seed", "options")
MIN_FLUSH_SECONDS = 5.0   # at most one write per this many seconds while the sweep runs
MAX_FLUSH_SHARE = 0.05    # and writing takes at most this share of the time


@dataclass
class Row:
    cell: Cell
    result: RunResult


def _arrow_type(hint):
    import pyarrow as pa

    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return _arrow_type(args[0])
    if hint is bool:
        return pa.bool_()
    if hint is int:
        return pa.int64()
    if hint is float:
        return pa.float64()
    if hint is str:
        return pa.string()
    if typing.get_origin(hint) is list:
        element = _arrow_type(args[0])
        return None if element is None else pa.list_(element)  # a list of objects: JSON text
    if hint is dict or typing.get_origin(hint) is dict:
        return None  # JSON text
    raise TypeError(f"RunResult field type {hint!r} has no column type")


def schema():
    """The results file's Arrow schema (module doc)."""
    import pyarrow as pa

    hints = typing.get_type_hints(RunResult)
    columns = [pa.field("cell", pa.string(), nullable=False), pa.field("mode", pa.string()),
               pa.field("seed", pa.int64()), pa.field("options", pa.string())]
    for item in fields(RunResult):
        columns.append(pa.field(item.name, _arrow_type(hints[item.name]) or pa.string()))
    return pa.schema(columns, metadata={METADATA_KEY: json.dumps({"format_version": FORMAT_VERSION}).encode()})


def _json_fields() -> set[str]:
    hints = typing.get_type_hints(RunResult)
    return {item.name for item in fields(RunResult) if _arrow_type(hints[item.name]) is None}


def _plain(value):
    """NumPy scalars and arrays as Python numbers and lists, for JSON."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def to_table(rows: list[Row]):
    import pyarrow as pa

    as_json = _json_fields()
    columns = {"cell": [row.cell.key for row in rows], "mode": [row.cell.mode for row in rows],
               "seed": [row.cell.seed for row in rows], "options": [row.cell.options for row in rows]}
    for item in fields(RunResult):
        values = [getattr(row.result, item.name) for row in rows]
        if item.name in as_json:
            values = [None if value is None else json.dumps(value, sort_keys=True, default=_plain) for value in values]
        columns[item.name] = values
    table = pa.Table.from_pydict(columns, schema=schema())
    metadata = dict(table.schema.metadata)
    metadata[CHECKSUM_KEY] = json.dumps(_digests(table, json.loads(metadata[METADATA_KEY]))).encode()
    return table.replace_schema_metadata(metadata)


def _digests(table, document: dict) -> dict:
    """The seal of a results table (module doc): SHA-256 of the metadata document and of every column's
    decoded values, each in canonical JSON."""
    def digest(value) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    return {"metadata": digest(document),
            "columns": {name: digest(table.column(name).to_pylist()) for name in table.column_names}}


def _verify(table, document: dict, stored: dict, path) -> None:
    """Refuse ``table`` unless it is what was sealed (``stored``: the file's schema metadata)."""
    if CHECKSUM_KEY not in stored:
        raise ConfigError(f"{path}: sweep results without a checksum (written by an older moe-offload, or "
                          "damaged); run the sweep into a new file")
    seal = parse_json(stored[CHECKSUM_KEY], path, "sweep results checksum")
    if seal != _digests(table, document):
        raise ConfigError(f"{path}: corrupt: the sweep results do not match their checksum (the file changed "
                          "after it was written); restore it or run the sweep into a new file")


def from_table(table) -> list[Row]:
    as_json = _json_fields()
    names = [item.name for item in fields(RunResult)]
    rows = []
    for record in table.to_pylist():
        values = {name: record[name] for name in names if name in record}
        for name in as_json:
            if values.get(name) is not None:
                values[name] = json.loads(values[name])
        rows.append(Row(Cell.from_key(record["cell"]), RunResult(**values)))
    return rows


def read_results(path) -> list[Row]:
    """The rows of a sweep results file; ConfigError when ``path`` is not one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        metadata = parquet.schema_arrow.metadata or {}
        if METADATA_KEY not in metadata:
            raise ConfigError(f"{path}: exists and is not a moe-offload sweep results file; give another output")
        document = parse_json(metadata[METADATA_KEY], path, "sweep results metadata")
        if not isinstance(document, dict):
            raise ConfigError(f"{path}: sweep results metadata must be a JSON object, not "
                              f"{type(document).__name__}")
        version = document.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ConfigError(f"{path}: sweep results format version {version!r} is newer than this moe-offload "
                              f"reads ({FORMAT_VERSION})")
        table = parquet.read()
        _verify(table, document, metadata, path)
    except (pa.ArrowException, OSError, ValueError, TypeError) as exc:  # not UTF-8; a column of another type
        raise ConfigError(f"{path}: not a readable sweep results file, corrupt or truncated ({exc})") from None
    # a file written before a RunResult field with a default was added lacks its column: the default holds
    defaulted = {item.name for item in fields(RunResult)
                 if item.default is not MISSING or item.default_factory is not MISSING}
    missing = [name for name in schema().names if name not in table.column_names and name not in defaulted]
    if missing:
        raise ConfigError(f"{path}: sweep results file without column(s) {', '.join(missing)}")
    try:
        return from_table(table.select([name for name in schema().names if name in table.column_names]))
    except (TypeError, ValueError, KeyError, RecursionError) as exc:
        raise ConfigError(f"{path}: a row of the sweep results file is not a cell and its result "
                          f"({type(exc).__name__}: {exc})") from None


def fill_opt_misses(rows: list[Row]) -> None:
    """Report every replay row against Belady's on the same trace, cache size and seed (simulate's rule); the
    rows without a seed (deterministic runs, Belady's among them: spec.py) belong to every seed."""
    by_seed: dict[int | None, list[RunResult]] = {None: []}
    for row in rows:
        if row.cell.mode == "replay":
            by_seed.setdefault(row.cell.seed, []).append(row.result)
    for seed, results in by_seed.items():
        set_opt_misses(results if seed is None else results + by_seed[None])


class ResultStore:
    """The results file of one sweep: the rows it held when the sweep started, and those added since."""

    def __init__(self, path, order: list[Cell]):
        self.path = Path(path)
        self._lock = _lock(self.path)
        self.rows: dict[str, Row] = {}
        try:
            if self.path.exists():
                self.rows = {row.cell.key: row for row in read_results(self.path)}
        except BaseException:
            self.close()
            raise
        self._rank = {cell.key: i for i, cell in enumerate(order)}
        self._dirty = False
        self._last_write = time.monotonic()
        self._write_seconds = 0.0

    def close(self) -> None:
        """Let another sweep write the file (the lock goes with the process too)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def done(self, cell: Cell) -> bool:
        return cell.key in self.rows

    def add(self, row: Row) -> None:
        """Record a finished cell; write the file if it is time to (module doc)."""
        self.rows[row.cell.key] = row
        self._dirty = True
        waited = time.monotonic() - self._last_write
        if waited >= max(MIN_FLUSH_SECONDS, self._write_seconds / MAX_FLUSH_SHARE):
            self.write()

    def write(self) -> None:
        """Write every row now, if any changed since the last write."""
        if not self._dirty:
            return
        import pyarrow.parquet as pq

        start = time.monotonic()
        fill_opt_misses(list(self.rows.values()))
        # the sweep's cells in its order, then rows of cells it no longer has, as they were
        ordered = sorted(self.rows.values(), key=lambda row: self._rank.get(row.cell.key, len(self._rank)))
        with atomic_output(self.path) as temporary:
            pq.write_table(to_table(ordered), temporary, compression="zstd")
        self._dirty = False
        self._last_write = time.monotonic()
        self._write_seconds = self._last_write - start


def _lock(path: Path) -> int:
    """An exclusive lock on ``.NAME.lock`` beside the results file (module doc): its descriptor, or ConfigError
    when another sweep holds it."""
    import fcntl

    lock = path.with_name(f".{path.name}.lock")
    try:
        # the output's folder may not exist yet: check_output vouched it can be made, atomic_output makes it too
        path.parent.mkdir(parents=True, exist_ok=True)
        written = Path(os.path.realpath(path))  # the file atomic_output replaces, whatever link names it
        lock = written.with_name(f".{written.name}.lock")
        descriptor = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise ConfigError(f"{lock}: cannot create the lock of the sweep results: {exc.strerror or exc}") from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(descriptor)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise ConfigError(f"{path}: another sweep is writing these results now; wait for it to end or give "
                              "another output") from None
        raise ConfigError(f"{lock}: cannot lock the sweep results: {exc.strerror or exc}") from None
    return descriptor
