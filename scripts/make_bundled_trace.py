"""Regenerate src/moe_offload/data/olmoe-1b-7b-decode299.parquet, the trace that ships with the package.

Usage: PYTHONPATH=src python3 scripts/make_bundled_trace.py [SOURCE.jsonl]

SOURCE defaults to ../shared/traces/olmoe-1b-7b/decode_299.jsonl, a copy of tests/trace_olmoe_299.jsonl of
sqliteai/warp at the commit below (Apache-2.0; attribution in src/moe_offload/data/NOTICE.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

from moe_offload.bundled import DEFAULT_TRACE
from moe_offload.trace.format import write_trace
from moe_offload.trace.importers import import_topk_jsonl

REPOSITORY = "sqliteai/warp"
COMMIT = "7f1fbba3cbaee0e9fdaffd940d87ff2dba9ee09b"
PATH_IN_REPOSITORY = "tests/trace_olmoe_299.jsonl"
# The prompt, from tools/trace_hf.py of the same repository and commit.
PROMPT = ("Write a C function that parses a JSON array of integers without using any external library, then "
          "explain its memory usage and edge cases, and finally propose unit tests for it.")

# OLMoE-1B-7B-0924: 16 MoE layers of 64 experts, top-8; each expert is a SwiGLU MLP (gate, up and down
# projections) between hidden size 2048 and intermediate size 1024, stored in bfloat16 (2 bytes).
HIDDEN_SIZE = 2048
INTERMEDIATE_SIZE = 1024
EXPERT_BYTES = 3 * HIDDEN_SIZE * INTERMEDIATE_SIZE * 2


def main(argv: list[str]) -> int:
    repo_root = Path(__file__).resolve().parents[1]
    source = Path(argv[0]) if argv else repo_root.parent / "shared" / "traces" / "olmoe-1b-7b" / "decode_299.jsonl"
    trace = import_topk_jsonl(
        source, num_experts=64, model="allenai/OLMoE-1B-7B-0924", expert_bytes=EXPERT_BYTES,
        hidden_size=HIDDEN_SIZE, license="Apache-2.0",
        source=f"{REPOSITORY} @ {COMMIT}, {PATH_IN_REPOSITORY}",
        extra={"files": [PATH_IN_REPOSITORY], "prompt": PROMPT,
               "prompt_source": f"{REPOSITORY} @ {COMMIT}, tools/trace_hf.py",
               "generation": "one prompt, batch 1, 299 greedy decode steps",
               "model_config": {"num_hidden_layers": 16, "num_experts": 64, "num_experts_per_tok": 8,
                                "hidden_size": HIDDEN_SIZE, "intermediate_size": INTERMEDIATE_SIZE,
                                "dtype": "bfloat16"}})
    path = write_trace(trace, DEFAULT_TRACE)
    print(f"wrote {path} ({path.stat().st_size} bytes, {trace.num_tokens} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
