"""The slow tier: the experts' layer files of a packed model, read chunk by chunk by a pool of reader threads.

An expert's region (runtime/packing.py) is read in chunks of the manifest's ``chunk_bytes``, each with one
positional read (``os.preadv``) straight into memory the caller names: a slot of the destination tier, a
pinned staging buffer, or a reader's own scratch buffer that the caller then converts from (``then``). The
chunks of one expert are spread over the reader threads, so one expert arrives at the rate of several
readers, and a reader checks and converts its chunk while it is still in the CPU's cache. No intermediate
``bytes`` object is made and nothing is parsed: offsets come from the manifest.

Integrity. A chunk's SHA-256 is checked the first time this process reads it (the set of verified chunks is
kept per file, by device, inode, size and modification time, for the whole process); later reads check its
xxHash3-64, about ten times faster. A mismatch is permanent: the read fails, naming the expert and the file.

Faults. A transient error (EINTR, EAGAIN, EIO, EBUSY, or a short read: the file ended before the chunk) is
retried with a short exponential backoff; when the retries are spent, or the error is permanent, the read
fails with an :class:`ExpertReadError` naming the expert, the layer file and the byte range. Tests inject
faults by replacing ``read_into`` (``(fd, view, offset) -> bytes read``).

``bypass_page_cache`` drops each chunk's pages from the page cache before reading it
(``posix_fadvise(DONTNEED)``), so that a measurement sees the device and not RAM.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from moe_offload.errors import MoeOffloadError
from moe_offload.runtime.packing import Manifest
from moe_offload.runtime.quantize import dequantize

TRANSIENT = {errno.EINTR, errno.EAGAIN, errno.EIO, errno.EBUSY}

_VERIFIED: set = set()  # (device, inode, size, mtime_ns, file offset) of chunks whose SHA-256 this process checked
_VERIFIED_LOCK = threading.Lock()


class ExpertReadError(MoeOffloadError):
    """An expert could not be read from the slow tier; the message names the expert and the file."""


def default_readers() -> int:
    """Reader threads: enough to keep a fast SSD or the page cache busy, no more than the cores."""
    return max(1, min(8, os.cpu_count() or 1))


def _preadv(fd: int, view: memoryview, offset: int) -> int:
    return os.preadv(fd, [view], offset)


class ExpertStore:
    def __init__(self, manifest: Manifest, *, verify: bool = True, bypass_page_cache: bool = False,
                 retries: int = 3, backoff_s: float = 0.01, readers: int | None = None,
                 read_into: Callable[[int, memoryview, int], int] = _preadv):
        self.manifest = manifest
        self.verify = verify
        self.bypass_page_cache = bypass_page_cache and hasattr(os, "posix_fadvise")
        self.retries = retries
        self.backoff_s = backoff_s
        self.read_into = read_into
        self.readers = readers or default_readers()
        self._pool = ThreadPoolExecutor(self.readers, thread_name_prefix="moe-offload reader") \
            if self.readers > 1 and len(manifest.chunks()) > 1 else None
        self._files: dict[int, tuple[int, tuple]] = {}  # layer -> (fd, file identity)
        self._lock = threading.Lock()
        self.reads = 0
        self.retried = 0
        self.bytes_read = 0

    # ------------------------------------------------------------------------------------------------ files
    def _file(self, layer: int) -> tuple[int, tuple]:
        opened = self._files.get(layer)
        if opened is not None:
            return opened
        with self._lock:
            if layer not in self._files:
                fd = os.open(self.manifest.layer_path(layer), os.O_RDONLY)
                st = os.fstat(fd)
                self._files[layer] = (fd, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
            return self._files[layer]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._lock:
            for fd, _ in self._files.values():
                os.close(fd)
            self._files.clear()

    # ------------------------------------------------------------------------------------------------ reads
    def read(self, layer: int, expert: int, into: Callable[[int, int], memoryview],
             then: Callable[[int, int, memoryview], None] | None = None) -> None:
        """Read expert ``(layer, expert)``: for every chunk [start, end) of its region, read it into
        ``into(start, end)`` (a writable buffer of end - start bytes), verify it, then call
        ``then(start, end, buffer)`` in the same reader thread. Returns when every chunk is done; raises
        ExpertReadError when one fails."""
        chunks = self.manifest.chunks()
        if self._pool is None:
            for start, end in chunks:
                self._chunk(layer, expert, start, end, into, then)
        else:
            futures = [self._pool.submit(self._chunk, layer, expert, start, end, into, then) for start, end in chunks]
            errors = [f.exception() for f in futures]
            error = next((e for e in errors if e is not None), None)
            if error is not None:
                raise error
        with self._lock:
            self.reads += 1
            self.bytes_read += self.manifest.expert_bytes

    def _chunk(self, layer, expert, start, end, into, then) -> None:
        manifest = self.manifest
        entry = manifest.experts[(layer, expert)]
        path = manifest.layer_path(layer)
        where = f"expert {expert} of layer {layer}: {path} (bytes {entry.offset + start}..{entry.offset + end})"
        index = start // manifest.chunk_bytes
        view = into(start, end)
        identity = self._read_range(layer, view, entry.offset + start, end - start, where)
        if self.verify:
            self._verify(view, entry, index, identity + (entry.offset + start,), where)
        if then is not None:
            then(start, end, view)

    def _read_range(self, layer: int, view: memoryview, offset: int, size: int, where: str) -> tuple:
        """Read ``size`` bytes at ``offset`` of the layer file into ``view``, retrying transient errors and
        short reads (module doc); returns the file's identity."""
        for attempt in range(self.retries + 1):
            try:
                fd, identity = self._file(layer)
                got = self._read_fully(fd, view, offset, size)
            except FileNotFoundError:
                raise ExpertReadError(f"{where}: missing") from None
            except OSError as exc:
                if exc.errno in TRANSIENT and attempt < self.retries:
                    self._backoff(attempt)
                    continue
                raise ExpertReadError(f"{where}: read failed after {attempt + 1} attempt(s): "
                                      f"{os.strerror(exc.errno) if exc.errno else exc}") from None
            if got != size:
                if attempt < self.retries:
                    self._backoff(attempt)
                    continue
                raise ExpertReadError(f"{where}: {got} bytes read, the manifest says {size} (truncated)")
            return identity

    def read_runs(self, layer: int, expert: int, runs: list[tuple[int, int]], into: memoryview) -> None:
        """Read the byte ranges ``runs`` ((offset in the expert's region, bytes), in order) of expert ``(layer,
        expert)`` one after the other into ``into``: a part of an expert (MoEpic's bottom segment,
        runtime/split.py), read in the calling thread. The chunk checksums cover whole chunks, so a part is not
        verified here: its reader checks it against a digest it took from a verified read of the whole expert."""
        entry = self.manifest.experts[(layer, expert)]
        path = self.manifest.layer_path(layer)
        filled = 0
        for offset, nbytes in runs:
            where = (f"expert {expert} of layer {layer}: {path} (bytes {entry.offset + offset}.."
                     f"{entry.offset + offset + nbytes})")
            self._read_range(layer, into[filled:filled + nbytes], entry.offset + offset, nbytes, where)
            filled += nbytes
        with self._lock:
            self.reads += 1
            self.bytes_read += filled

    def _read_fully(self, fd: int, view: memoryview, offset: int, size: int) -> int:
        if self.bypass_page_cache:
            os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)
        got = 0
        while got < size:  # a short read continues where it stopped
            n = self.read_into(fd, view[got:size], offset + got)
            if not n:
                break  # end of file before the manifest's size: the caller retries or reports
            got += n
        return got

    def _backoff(self, attempt: int) -> None:
        with self._lock:
            self.retried += 1
        time.sleep(self.backoff_s * (2 ** attempt))

    @staticmethod
    def _verify(view, entry, index: int, chunk_id: tuple, where: str) -> None:
        import xxhash

        if chunk_id in _VERIFIED:
            ok = xxhash.xxh3_64_hexdigest(view) == entry.xxh3[index]
        else:
            ok = hashlib.sha256(view).hexdigest() == entry.sha256[index]
            if ok:
                with _VERIFIED_LOCK:
                    _VERIFIED.add(chunk_id)
        if not ok:
            raise ExpertReadError(f"{where}: checksum mismatch (the file is corrupt or was replaced)")

    def read_tensors(self, layer: int, expert: int) -> dict:
        """The expert's tensors (CPU, stored dtype, freshly allocated): for measurements and tests, not the hot
        path."""
        import torch

        region = torch.empty(self.manifest.expert_bytes, dtype=torch.uint8)
        array = region.numpy()
        self.read(layer, expert, lambda start, end: memoryview(array[start:end]))
        return expert_views(self.manifest, region)


def expert_views(manifest: Manifest, region, dtype=None) -> dict:
    """The expert's tensors as views of ``region``, a flat tensor holding one expert: a uint8 tensor of its
    stored bytes, or a tensor of elements (a compute-ready copy in another dtype, the same element order).
    Quantized experts (always uint8 bytes) are dequantized into new tensors of ``dtype`` instead (quantize.py)."""
    import torch

    if manifest.quantized:
        return {tensor.name: dequantize(region[tensor.offset:tensor.offset + tensor.nbytes], tensor.shape,
                                        manifest.expert_dtype, dtype or getattr(torch, manifest.dtype))
                for tensor in manifest.tensors}
    stored = getattr(torch, manifest.dtype)
    flat = region.view(stored) if region.dtype == torch.uint8 else region
    out, itemsize = {}, stored.itemsize
    for tensor in manifest.tensors:
        first = tensor.offset // itemsize
        out[tensor.name] = flat[first:first + tensor.nbytes // itemsize].view(tensor.shape)
    return out
