"""Bit-flip sweep: flip every bit of a trace file, one at a time, and read each damaged copy back.

    python benchmarks/bitflip.py [TRACE] [--jobs 2] [--stride 1]

TRACE defaults to the bundled OLMoE trace (28.9 kB: 230,880 flips). Each damaged copy is written to a
scratch file (in /dev/shm where there is one) and read with ``read_trace``, the reader every command uses,
and its outcome counted:

* identical: it reads back exactly as the intact file (metadata and every column, bit for bit), so every
  result computed from it is the intact file's;
* refused: a TraceError in one line that names the file (exit 2 on the command line);
* DIFFERENT: it reads back as other data without an error: a silently changed result;
* CRASH: any other exception (a traceback on the command line) or an error that is not one line naming the
  file. A reading process that dies (a crash in native code) stops the sweep with its byte range.

Counts are printed by region of the file (the leading magic, the column chunks' pages, the footer with the
schema, the metadata and the checksum). The command fails (exit 1) unless DIFFERENT and CRASH are both 0.
``--stride N`` flips the bits of every N-th byte only, for a quick look.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from moe_offload.bundled import DEFAULT_TRACE
from moe_offload.errors import MoeOffloadError
from moe_offload.trace.format import Trace, read_trace

OUTCOMES = ("identical", "refused", "DIFFERENT", "CRASH")
_CLEAN: Trace | None = None
_DATA: bytes = b""
_SCRATCH: str = ""


def same_trace(a: Trace, b: Trace) -> bool:
    """Whether ``a`` and ``b`` hold the same metadata and the same columns, bit for bit."""
    if a.meta != b.meta:
        return False
    for name in ("request", "position", "phase", "iteration", "experts", "weights", "probs", "embedding",
                 "gate_prediction"):
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None):
            return False
        if x is not None and (x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes()):
            return False
    return True


def regions(path: Path, size: int) -> np.ndarray:
    """Per byte of the file: 0 magic, 1 column pages, 2 footer (schema, key-value metadata, checksum)."""
    import pyarrow.parquet as pq

    region = np.full(size, 2, dtype=np.int8)
    region[:4] = 0
    metadata = pq.ParquetFile(path).metadata
    for group in range(metadata.num_row_groups):
        for column in range(metadata.num_columns):
            chunk = metadata.row_group(group).column(column)
            start = min(offset for offset in (chunk.dictionary_page_offset, chunk.data_page_offset)
                        if offset is not None and offset > 0)
            region[start:start + chunk.total_compressed_size] = 1
    return region


def _init(data: bytes, clean: Trace, scratch: str) -> None:
    global _DATA, _CLEAN, _SCRATCH
    _DATA, _CLEAN, _SCRATCH = data, clean, scratch


def _classify(position_bit: tuple[int, int]) -> tuple[int, int, str, str]:
    position, bit = position_bit
    damaged = bytearray(_DATA)
    damaged[position] ^= 1 << bit
    path = os.path.join(_SCRATCH, f"flip-{os.getpid()}.parquet")
    with open(path, "wb") as out:
        out.write(damaged)
    try:
        trace = read_trace(path)
    except MoeOffloadError as exc:
        message = str(exc)
        if path not in message or "\n" in message:
            return position, bit, "CRASH", f"an error that is not one line naming the file: {message!r}"
        return position, bit, "refused", ""
    except Exception:  # noqa: BLE001 - what the sweep is looking for
        return position, bit, "CRASH", traceback.format_exc(limit=3).strip().splitlines()[-1]
    return position, bit, ("identical" if same_trace(trace, _CLEAN) else "DIFFERENT"), ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE), help="trace file (default: the bundled OLMoE)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes (default 2)")
    parser.add_argument("--stride", type=int, default=1, help="flip the bits of every N-th byte (default 1: all)")
    args = parser.parse_args()

    path = Path(args.trace)
    data = path.read_bytes()
    clean = read_trace(path)
    region = regions(path, len(data))
    flips = [(position, bit) for position in range(0, len(data), args.stride) for bit in range(8)]
    scratch = tempfile.mkdtemp(prefix="bitflip-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    which = "every byte" if args.stride == 1 else f"every {args.stride}th byte"
    print(f"{path}: {len(data):,} bytes, {len(flips):,} flips ({which}, every bit), {args.jobs} processes", flush=True)
    counts = {name: Counter() for name in ("magic", "column pages", "footer")}
    examples: list[str] = []
    start = time.perf_counter()
    context = multiprocessing.get_context("fork")
    try:
        with ProcessPoolExecutor(args.jobs, mp_context=context, initializer=_init,
                                 initargs=(data, clean, scratch)) as pool:
            for position, bit, outcome, detail in pool.map(_classify, flips, chunksize=256):
                counts[("magic", "column pages", "footer")[region[position]]][outcome] += 1
                if detail and len(examples) < 10:
                    examples.append(f"byte {position} bit {bit}: {outcome}: {detail}")
    except BrokenProcessPool:
        done = sum(sum(counted.values()) for counted in counts.values())
        print(f"a reading process died (a crash in native code) after {done:,} flips, near byte "
              f"{flips[min(done, len(flips) - 1)][0]}")
        return 1
    finally:
        for leftover in Path(scratch).iterdir():
            leftover.unlink()
        os.rmdir(scratch)
    elapsed = time.perf_counter() - start

    total = sum(counts.values(), Counter())
    width = max(len(name) for name in counts)
    print(f"{'region':<{width}} {'bytes':>8} " + " ".join(f"{name:>10}" for name in OUTCOMES))
    for name, counted in counts.items():
        print(f"{name:<{width}} {int(np.count_nonzero(region == list(counts).index(name))):>8,} "
              + " ".join(f"{counted[outcome]:>10,}" for outcome in OUTCOMES))
    print(f"{'all':<{width}} {len(data):>8,} " + " ".join(f"{total[outcome]:>10,}" for outcome in OUTCOMES))
    print(f"{len(flips):,} flips in {elapsed:.0f} s ({elapsed / len(flips) * 1e3:.2f} ms each)")
    for example in examples:
        print(f"  {example}")
    bad = total["DIFFERENT"] + total["CRASH"]
    print("every flip read back identical or was refused in one line" if not bad else
          f"{bad:,} flips gave different data or a traceback")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
