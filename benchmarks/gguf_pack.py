"""How long packing a GGUF checkpoint takes beside packing the same model's safetensors checkpoint: the tiny
random Qwen3-MoE of tests/test_gguf.py (tests/gguf_files.py), written as an F32 and a Q8_0 GGUF, each packed with
``moe-offload pack`` (runtime/packing.py) into a fresh directory, median of ``--repeat`` runs.

    python benchmarks/gguf_pack.py [--repeat 3] [--json FILE]

A GGUF pack reads the file through transformers (dequantizing every tensor), saves the float checkpoint and
packs that, so its time is the safetensors pack's plus the reading and the saving.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the GGUF writer of the tests


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="packs per source (median reported; default 3)")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    args = parser.parse_args(argv)

    from gguf_files import save_checkpoint, tiny_qwen3_moe, write_gguf

    from moe_offload.models import quiet_transformers
    from moe_offload.runtime.packing import pack_model

    quiet_transformers()
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        model = tiny_qwen3_moe()
        f32 = write_gguf(model, folder / "tiny-F32.gguf")
        sources = {"safetensors": save_checkpoint(model, folder / "checkpoint", f32), "gguf-F32": f32,
                   "gguf-Q8_0": write_gguf(model, folder / "tiny-Q8_0.gguf", quantization="Q8_0")}
        results = {}
        for name, source in sources.items():
            seconds = []
            for run in range(args.repeat):
                started = time.perf_counter()
                pack_model(source, folder / f"{name}-{run}")
                seconds.append(time.perf_counter() - started)
            results[name] = {"median_s": statistics.median(seconds), "runs_s": seconds,
                             "source_bytes": sum(path.stat().st_size for path in
                                                 ([source] if source.is_file() else source.iterdir()))}
    base = results["safetensors"]["median_s"]
    print(f"{'source':<12} {'bytes':>10} {'pack (median)':>14} {'x safetensors':>14}")
    for name, result in results.items():
        print(f"{name:<12} {result['source_bytes']:>10} {result['median_s'] * 1000:>11.0f} ms "
              f"{result['median_s'] / base:>13.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
