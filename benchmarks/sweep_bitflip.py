"""Bit-flip sweep of a sweep's results file: flip bits of a small results file, one at a time, and read each
damaged copy back with ``read_results`` (what a resumed sweep reads).

    python benchmarks/sweep_bitflip.py [--stride 29]     # about 5,300 flips, under a minute on 2 cores
    python benchmarks/sweep_bitflip.py --stride 1        # every bit of the file (about 150,000 flips)

The results file is written by a real sweep (two policies, one cache size, a 30-token Zipf trace) in a
temporary folder. Each damaged copy is read from memory and counted as identical (it reads back as the rows
written), refused (a one-line ConfigError naming the file), DIFFERENT (other rows without an error: what a
resumed sweep would report as its results) or CRASH (any other exception). Exit status 1 unless DIFFERENT and
CRASH are both 0. ``--stride N`` flips every bit of every N-th byte.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
import time

SWEEP = """
traces = ["zipf.parquet"]
policies = ["lru", "lfu"]
cache_sizes = [3]
output = "results.parquet"
"""


def results_file(folder: str) -> bytes:
    from moe_offload.cli.main import main
    from moe_offload.trace.format import write_trace
    from moe_offload.trace.synthetic import zipf_trace

    write_trace(zipf_trace(num_layers=2, num_experts=6, top_k=2, length=30, a=1.0, b=1.0, seed=1),
                os.path.join(folder, "zipf.parquet"))
    with open(os.path.join(folder, "sweep.toml"), "w") as handle:
        handle.write(SWEEP)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if main(["sweep", os.path.join(folder, "sweep.toml")]) != 0:
            raise SystemExit("the sweep that writes the results file failed")
    with open(os.path.join(folder, "results.parquet"), "rb") as handle:
        return handle.read()


def main() -> int:
    import pyarrow as pa

    from moe_offload import values
    from moe_offload.errors import ConfigError
    from moe_offload.sweep.store import read_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stride", type=int, default=29, help="flip every bit of every N-th byte (default 29)")
    args = parser.parse_args()
    values.integer(args.stride, "--stride", low=1)
    with tempfile.TemporaryDirectory() as folder:
        clean_bytes = results_file(folder)
    clean = read_results(pa.BufferReader(clean_bytes))
    counts = {"identical": 0, "refused": 0, "DIFFERENT": 0, "CRASH": 0}
    started = time.perf_counter()
    for offset in range(0, len(clean_bytes), args.stride):
        for bit in range(8):
            damaged = bytearray(clean_bytes)
            damaged[offset] ^= 1 << bit
            try:
                rows = read_results(pa.BufferReader(bytes(damaged)))
            except ConfigError:
                counts["refused"] += 1
                continue
            except Exception:  # noqa: BLE001 - what the sweep counts: a traceback on the command line
                counts["CRASH"] += 1
                continue
            counts["identical" if rows == clean else "DIFFERENT"] += 1
    flips = sum(counts.values())
    print(f"{len(clean_bytes):,} bytes, {flips:,} flips in {time.perf_counter() - started:.0f} s: "
          + ", ".join(f"{name} {count:,}" for name, count in counts.items()))
    return 1 if counts["DIFFERENT"] or counts["CRASH"] else 0


if __name__ == "__main__":
    from script import run

    run(main)
