"""The slow tier: expert files of a packed model, read with positional reads.

Every read is one ``os.pread`` loop over the whole file (short reads continue where they stopped), optionally
after ``posix_fadvise(DONTNEED)`` so that the kernel's page cache does not hide the device's real speed
(``bypass_page_cache``). The bytes are checked against the manifest's SHA-256 before any tensor is made from
them. A transient error (EINTR, EAGAIN, EIO, a short file that grows back) is retried with a short backoff;
when the retries are spent, or the error is permanent (missing file, checksum mismatch), the read fails
with an :class:`ExpertReadError` naming the expert and the file. Tests inject faults by replacing
``read_at``.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
from typing import Callable

from moe_offload.errors import MoeOffloadError
from moe_offload.runtime.packing import Manifest

TRANSIENT = {errno.EINTR, errno.EAGAIN, errno.EIO, errno.EBUSY}


class ExpertReadError(MoeOffloadError):
    """An expert could not be read from the slow tier; the message names the expert and the file."""


class ExpertStore:
    def __init__(self, manifest: Manifest, *, verify: bool = True, bypass_page_cache: bool = False,
                 retries: int = 3, backoff_s: float = 0.01,
                 read_at: Callable[[int, int, int], bytes] = os.pread):
        self.manifest = manifest
        self.verify = verify
        self.bypass_page_cache = bypass_page_cache and hasattr(os, "posix_fadvise")
        self.retries = retries
        self.backoff_s = backoff_s
        self.read_at = read_at
        self.reads = 0
        self.retried = 0
        self.bytes_read = 0

    def read_bytes(self, layer: int, expert: int) -> bytes:
        entry = self.manifest.experts[(layer, expert)]
        path = self.manifest.directory / entry.path
        where = f"expert {expert} of layer {layer}: {path}"
        for attempt in range(self.retries + 1):
            try:
                data = self._read_once(path, entry.nbytes)
            except FileNotFoundError:
                raise ExpertReadError(f"{where}: missing") from None
            except OSError as exc:
                if exc.errno in TRANSIENT and attempt < self.retries:
                    self.retried += 1
                    time.sleep(self.backoff_s * (2 ** attempt))
                    continue
                raise ExpertReadError(f"{where}: read failed after {attempt + 1} attempt(s): "
                                      f"{os.strerror(exc.errno) if exc.errno else exc}") from None
            if len(data) != entry.nbytes:
                if attempt < self.retries:
                    self.retried += 1
                    time.sleep(self.backoff_s * (2 ** attempt))
                    continue
                raise ExpertReadError(f"{where}: {len(data)} bytes read, the manifest says {entry.nbytes} "
                                      "(truncated)")
            if self.verify and hashlib.sha256(data).hexdigest() != entry.sha256:
                raise ExpertReadError(f"{where}: checksum mismatch (the file is corrupt or was replaced)")
            self.reads += 1
            self.bytes_read += len(data)
            return data
        raise AssertionError("unreachable")

    def _read_once(self, path, nbytes: int) -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            if self.bypass_page_cache:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            chunks, offset = [], 0
            while offset < nbytes:
                chunk = self.read_at(fd, nbytes - offset, offset)
                if not chunk:
                    break  # end of file before the manifest's size: the caller reports or retries
                chunks.append(chunk)
                offset += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def read_tensors(self, layer: int, expert: int) -> dict:
        """The expert's tensors (CPU, stored dtype) from one verified read."""
        from safetensors.torch import load

        data = self.read_bytes(layer, expert)
        try:
            return load(data)
        except Exception as exc:  # a header the checksum did not cover (verify=False)
            entry = self.manifest.experts[(layer, expert)]
            raise ExpertReadError(f"expert {expert} of layer {layer}: {self.manifest.directory / entry.path}: "
                                  f"not a safetensors file ({exc})") from None
