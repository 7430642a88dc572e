"""The checksum that seals a trace file: a trace reads back exactly as it was written, or not at all.

Why a checksum of the content and not Parquet's page checksums: a page CRC covers a page's bytes, but not
the page headers, the footer (row counts, the schema, the column types) or the key-value metadata where
the trace's model description lives; a bit flipped in any of those reads back as different data without
a word. So the writer seals what the reader will produce: a SHA-256 of the metadata (its canonical JSON)
and one of every column as decoded (its name, NumPy dtype, shape and bytes), stored under the schema
metadata key ``moe_offload.checksum``::

    {"algorithm": "sha256", "metadata": "<hex>", "columns": {"request": "<hex>", "experts": "<hex>", ...}}

The reader decodes, recomputes and compares, before any other check: a corrupt file is one error naming
the file and what does not match, whatever byte was hit (the bit-flip sweep of benchmarks/bitflip.py
flips every bit of the bundled trace to show it). Per-column digests let a reader that loads only some
columns verify exactly those. The digests are independent of the Parquet encoding, so a file rewritten by
another Parquet writer with the same content keeps its checksum.

This module knows nothing of the columns' meaning: ``trace/format.py`` hands it the metadata document and
the decoded arrays by name.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from moe_offload.errors import TraceError

CHECKSUM_KEY = b"moe_offload.checksum"
ALGORITHM = "sha256"


def metadata_digest(document: dict) -> str:
    """SHA-256 of the metadata document in canonical JSON (sorted keys, no spaces)."""
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def column_digest(name: str, values: np.ndarray) -> str:
    """SHA-256 of a decoded column: its name, dtype and shape, then its bytes in C order."""
    values = np.ascontiguousarray(values)
    digest = hashlib.sha256(f"{name}|{values.dtype.str}|{values.shape}|".encode())
    digest.update(values.reshape(-1).view(np.uint8))  # (a memoryview cannot be cast when a dimension is 0)
    return digest.hexdigest()


def seal(document: dict, columns: dict[str, np.ndarray]) -> bytes:
    """The value of CHECKSUM_KEY for a file holding ``document`` and ``columns``."""
    return json.dumps({"algorithm": ALGORITHM, "metadata": metadata_digest(document),
                       "columns": {name: column_digest(name, values) for name, values in columns.items()}},
                      sort_keys=True).encode()


class Seal:
    """A file's stored checksum, parsed; ``verify_*`` raise TraceError naming the file on a mismatch."""

    def __init__(self, raw: bytes, path):
        self.path = path
        try:
            stored = json.loads(raw)
        except (ValueError, RecursionError):
            stored = None
        columns = stored.get("columns") if isinstance(stored, dict) else None
        if (not isinstance(stored, dict) or stored.get("algorithm") != ALGORITHM
                or not isinstance(stored.get("metadata"), str) or not isinstance(columns, dict)
                or not all(isinstance(name, str) and isinstance(value, str) for name, value in columns.items())):
            self._corrupt("its checksum record is damaged")
        self.metadata, self.columns = stored["metadata"], columns

    def _corrupt(self, what: str):
        raise TraceError(self.path, f"corrupt: {what} (the file changed after it was written; "
                                    "restore it or record it again)")

    def verify_metadata(self, document: dict) -> None:
        if metadata_digest(document) != self.metadata:
            self._corrupt("its metadata does not match the checksum")

    def verify_columns(self, present: list[str], columns: dict[str, np.ndarray]) -> None:
        """``present``: the columns the file holds; ``columns``: those decoded, each checked."""
        unsealed = sorted(set(present) - set(self.columns))
        if unsealed:
            self._corrupt(f"column {unsealed[0]} is not covered by the checksum")
        missing = sorted(set(self.columns) - set(present))
        if missing:
            self._corrupt(f"column {missing[0]}, which the checksum covers, is missing")
        for name, values in columns.items():
            if column_digest(name, values) != self.columns[name]:
                self._corrupt(f"column {name} does not match the checksum")
