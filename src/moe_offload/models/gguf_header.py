"""A GGUF file's header walked with every declared count checked against the bytes that are left, before the
``gguf`` package's reader sees it.

The ``gguf`` package's ``GGUFReader`` trusts the counts a header declares: it loops over an array's declared
length building a NumPy view per entry (gguf_reader.py, ``_get_field_parts``), so a 4 kB file whose header holds
an array of 2^40 entries runs for minutes and takes gigabytes before failing. The layout (llama.cpp's
ggml/include/gguf.h; the reader's own ``_build_fields`` and ``_build_tensor_info``): the magic ``GGUF``, a
``uint32`` version (2 or 3; in the file's byte order, which a version whose low half is 0 reveals to be the
other one), ``uint64`` tensor and key-value counts, the key-value pairs (a string key, a ``uint32`` type, the
value: a scalar, a string as a ``uint64`` length and its bytes, or an array as a ``uint32`` element type, a
``uint64`` count and the elements), then per tensor its name, a ``uint32`` number of dimensions (at most 4,
ggml's ``GGML_MAX_DIMS``), the ``uint64`` dimensions, a ``uint32`` type and a ``uint64`` offset.

:func:`check_layout` walks that layout and refuses, in one line naming the file, a count that the rest of the
file cannot hold (an array's elements take at least a byte each, a string's length is its bytes, a
key-value pair at least 13 bytes, a tensor's entry at least 24), an unknown value type and a header that ends
early. Every loop is bounded by the file's size, so the walk takes time proportional to the header's bytes.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from moe_offload.errors import ConfigError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_NESTING = 8  # arrays of arrays: llama.cpp writes none; deeper is a hostile header
# GGUFValueType -> bytes of one value (STRING 8 and ARRAY 9 are variable)
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
KV_MIN_BYTES = 8 + 4 + 1      # an empty key, a type, a one-byte value
TENSOR_MIN_BYTES = 8 + 4 + 4 + 8  # an empty name, no dimension, a type, an offset


class _Header:
    """A cursor over the file's bytes that refuses, naming the file, to read past their end."""

    def __init__(self, path: Path, data):
        self.path, self.data, self.offset = path, data, 0
        self.order = "<"

    def left(self) -> int:
        return len(self.data) - self.offset

    def refuse(self, problem: str):
        raise ConfigError(f"{self.path}: not a readable GGUF file: {problem}")

    def take(self, count: int, what: str) -> int:
        if count > self.left():
            self.refuse(f"{what} at byte {self.offset} needs {count:,} bytes, the file has {self.left():,} left "
                        "(truncated, or a corrupt count)")
        start = self.offset
        self.offset += count
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from(self.order + "I", self.data, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from(self.order + "Q", self.data, self.take(8, what))[0]

    def string(self, what: str) -> None:
        self.take(self.u64(f"the length of {what}"), what)

    def count(self, what: str, smallest: int) -> int:
        """A declared number of entries of at least ``smallest`` bytes each, checked against the bytes left."""
        number = self.u64(f"the count of {what}")
        if number * smallest > self.left():
            self.refuse(f"declares {number:,} {what}, more than the {self.left():,} bytes left could hold")
        return number

    def value(self, kind: int, key_offset: int, depth: int = 0) -> None:
        if kind in SCALAR_BYTES:
            self.take(SCALAR_BYTES[kind], "a value")
        elif kind == STRING:
            self.string("a string value")
        elif kind == ARRAY:
            if depth >= MAX_NESTING:
                self.refuse(f"the key at byte {key_offset} nests arrays more than {MAX_NESTING} deep")
            element = self.u32("an array's element type")
            if element in SCALAR_BYTES:
                self.take(self.count("array elements", SCALAR_BYTES[element]) * SCALAR_BYTES[element],
                          "an array's elements")
            elif element in (STRING, ARRAY):
                for _ in range(self.count("array elements", 8 if element == STRING else 12)):
                    self.value(element, key_offset, depth + 1)
            else:
                self.refuse(f"the key at byte {key_offset} has arrays of unknown type {element}")
        else:
            self.refuse(f"the key at byte {key_offset} has a value of unknown type {kind}")


def check_layout(path: Path) -> None:
    """ConfigError in one line naming ``path`` unless its header has GGUF's layout (module docstring) with
    every count within the file's size."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            if size < len(MAGIC) + 4 + 16:
                raise ConfigError(f"{path}: not a GGUF file ({size} bytes, shorter than a GGUF header)")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _walk(_Header(path, data))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the GGUF file: {exc.strerror or exc}") from None


def _walk(header: _Header) -> None:
    if header.data[:4] != MAGIC:
        header.refuse("it does not begin with GGUF's magic bytes")
    header.offset = 4
    version = header.u32("the version")
    if version & 0xFFFF == 0:  # written in the other byte order (as the gguf reader tells)
        header.order = ">"
        version = struct.unpack("<I", struct.pack(">I", version))[0]
    if version not in VERSIONS:
        header.refuse(f"GGUF version {version}; versions {' and '.join(map(str, VERSIONS))} are read")
    tensors = header.u64("the tensor count")
    pairs = header.count("key-value pairs", KV_MIN_BYTES)
    if tensors * TENSOR_MIN_BYTES > header.left():
        header.refuse(f"declares {tensors:,} tensors, more than the {header.left():,} bytes left could hold")
    for _ in range(pairs):
        key_offset = header.offset
        header.string("a key")
        header.value(header.u32("a value type"), key_offset)
    for _ in range(tensors):
        header.string("a tensor name")
        dims = header.u32("a tensor's number of dimensions")
        if dims > MAX_DIMS:
            header.refuse(f"a tensor at byte {header.offset} has {dims:,} dimensions (ggml has at most {MAX_DIMS})")
        header.take(8 * dims + 4 + 8, "a tensor's dimensions, type and offset")
