"""NumPy arrays read from untrusted bytes: a ``.npy`` header is checked before anything is allocated from it.

``numpy.load`` allocates the array its header declares before it reads a byte of data, so a 100-byte
header that claims ``(2**40, 2**40)`` int64 asks for 93 TiB. Here the declared size is computed with
Python integers (no overflow), compared with the bytes that really follow the header (a ``.npy`` cannot
hold more data than it has) and with ``max_bytes``, the largest array an import may decode (a compressed
``.npz`` member can inflate far beyond its file: ``--max-array-bytes`` raises the limit). Only then are the
bytes read and viewed as the array. Object arrays (pickles) are refused.

The ``.npy`` layout is NumPy's own (``numpy.lib.format``): magic, version, header length, a Python-literal
dict with ``descr``, ``fortran_order`` and ``shape``, then the raw data.
"""

from __future__ import annotations

import io
import math
import zipfile
from pathlib import Path

import numpy as np

from moe_offload.errors import TraceError
from moe_offload.inputs import check_input, check_memory

# The largest array one import decodes by default: 2 GiB of ids is a 27-million-token trace of a
# 48-layer top-8 model in int16, far past any capture that fits a response file.
DEFAULT_MAX_ARRAY_BYTES = 2 * 2**30


def read_npy(raw: bytes, path, where: str, max_bytes: int = DEFAULT_MAX_ARRAY_BYTES, *, row: int | None = None,
             unit: str = "response") -> np.ndarray:
    """The array of the ``.npy`` bytes ``raw``; TraceError naming ``path``, the ``row`` and ``where`` else."""
    def fail(problem: str):
        raise TraceError(path, f"{where}: {problem}", row=row, unit=unit)

    stream = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
    except (ValueError, TypeError, SyntaxError, OverflowError, RecursionError, MemoryError) as exc:
        fail(f"not a readable .npy array ({_short(exc)})")
    if dtype.hasobject:
        fail("holds Python objects (a pickle), not numbers")
    count = math.prod(shape)
    declared = count * dtype.itemsize
    available = len(raw) - stream.tell()
    if declared > max_bytes:
        fail(f"its header declares {list(shape)} {dtype} = {declared:,} bytes, more than the {max_bytes:,} "
             "an import decodes (--max-array-bytes raises the limit)")
    if declared != available:
        fail(f"its header declares {list(shape)} {dtype} = {declared:,} bytes, but {available:,} bytes follow it "
             "(truncated or corrupt)")
    check_memory(declared, path, f"{where} ({list(shape)} {dtype})", TraceError)
    array = np.frombuffer(raw, dtype=dtype, count=count, offset=stream.tell())
    return array.reshape(shape, order="F" if fortran else "C")


def read_npy_file(path: Path, max_bytes: int = DEFAULT_MAX_ARRAY_BYTES) -> np.ndarray:
    """The array of a ``.npy`` file, its header checked against the file's size first."""
    check_input(path, "NumPy array", TraceError)
    size = path.stat().st_size
    if size > max_bytes + 2**16:  # the header is at most 64 KiB beside the data
        raise TraceError(path, f"{size:,} bytes, more than the {max_bytes:,} an import decodes "
                               "(--max-array-bytes raises the limit)")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TraceError(path, f"cannot read the NumPy array ({exc.strerror or exc})") from None
    return read_npy(raw, path, "array 0", max_bytes, unit="array")


def read_npz(path: Path, max_bytes: int = DEFAULT_MAX_ARRAY_BYTES) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` (a zip of ``.npy`` members, as ``numpy.savez`` writes), by name in stored
    order; each member's declared size is checked before it is inflated."""
    check_input(path, "NumPy archive", TraceError)
    if not zipfile.is_zipfile(path):
        raise TraceError(path, "not an .npz archive (a zip file of .npy arrays, as numpy.savez writes)")
    arrays: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                name = (info.filename[:-4] if info.filename.endswith(".npy") else info.filename)[:100]
                if info.file_size > max_bytes + 2**16:
                    raise TraceError(path, f"array {name!r}: {info.file_size:,} bytes inflated, more than the "
                                           f"{max_bytes:,} an import decodes (--max-array-bytes raises the limit)")
                with archive.open(info) as member:
                    raw = member.read(info.file_size + 1)
                arrays[name] = read_npy(raw, path, f"array {name!r}", max_bytes, row=None)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, NotImplementedError, ValueError) as exc:
        raise TraceError(path, f"not a readable .npz archive ({_short(exc)})") from None
    return arrays


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
