"""Files that ship inside the package (see src/moe_offload/data/NOTICE.md for their sources and licenses)."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"

# OLMoE-1B-7B, 299 greedy decode steps of one prompt (Apache-2.0, from sqliteai/warp); the default trace.
DEFAULT_TRACE = DATA_DIR / "olmoe-1b-7b-decode299.parquet"

# FlashMoE-style learned eviction network, trained by `moe-offload train-eviction` (see NOTICE.md).
DEFAULT_LEARNED_MODEL = DATA_DIR / "learned-eviction.npz"

# The tiny Mixtral (8 layers x 8 experts, top-2) trained by `moe-offload train-tiny`, with its tokenizer and
# training report; `--model tiny` everywhere.
TINY_MODEL_DIR = DATA_DIR / "tiny-mixtral"

# Routing of the tiny model on ShareGPT and HumanEval prompts, recorded by `moe-offload record` with every
# column (probs, embedding, gate_prediction, next_token_gate_prediction); the second default trace.
DEFAULT_TINY_TRACE = DATA_DIR / "tiny-mixtral-sharegpt-humaneval.parquet"

# The same recording on the next prompts of both sources: the history that MoE-Infinity's and fMoE's
# prefetchers learn from before they run on DEFAULT_TINY_TRACE (no prompt is in both).
TINY_HISTORY_TRACE = DATA_DIR / "tiny-mixtral-history.parquet"

# Names a command accepts in place of a trace file.
DEFAULT_TRACE_NAME = "olmoe"  # what the commands call DEFAULT_TRACE
BUNDLED_TRACES = {DEFAULT_TRACE_NAME: DEFAULT_TRACE, "tiny": DEFAULT_TINY_TRACE, "tiny-history": TINY_HISTORY_TRACE}


def trace_path(name: str) -> Path:
    """A trace argument: ``olmoe``, ``tiny`` or ``tiny-history`` (the bundled traces) unless a file of that
    name exists."""
    if name in BUNDLED_TRACES and not Path(name).exists():
        return BUNDLED_TRACES[name]
    return Path(name)
