"""Whether a trace has the columns a prefetcher cannot work without, and how to get them when it has not.

Below prefetch/base.py, which checks a routing view with it: it reads a prefetcher class's ``name`` and
``requires`` and imports nothing of the prefetchers."""

from __future__ import annotations

from moe_offload.errors import ConfigError
from moe_offload.trace.format import EMBEDDING_TOKEN, Trace

# column -> (what it holds, how to get a trace that has it)
COLUMN_HELP = {
    "probs": ("the router's full probability distribution over all experts of every layer",
              "record the trace with full router probabilities (traces imported from top-k expert lists "
              "have only the selected experts)"),
    "embedding": ("the model's input embedding of every token",
                  "record the trace with `moe-offload record`; a trace of format version 1 holds the request's "
                  "prompt mean on every row instead, which would make each request's iterations match each "
                  "other: record it again"),
    "gate_prediction": ("layer l+1's router applied to layer l's hidden state",
                        "record the trace with next-layer gate predictions"),
    "weights": ("the router weights of the selected experts", "record the trace with router weights"),
}


def has_column(trace: Trace, column: str) -> bool:
    """Whether ``trace`` holds ``column`` as the prefetchers read it: the embedding only per token."""
    if column == "embedding" and trace.meta.embedding_kind != EMBEDDING_TOKEN:
        return False
    return getattr(trace, column) is not None


def check_trace_columns(prefetcher: type, trace: Trace) -> None:
    """Raise ConfigError naming the prefetcher (a Prefetcher class: its ``name`` and the columns it ``requires``),
    every missing column and how to get it."""
    missing = [column for column in prefetcher.requires if not has_column(trace, column)]
    if not missing:
        return
    problems = "; ".join(f"column {column!r} ({COLUMN_HELP[column][0]}): {COLUMN_HELP[column][1]}"
                         for column in missing)
    raise ConfigError(f"prefetcher {prefetcher.name!r} needs trace columns that {trace.path} lacks: {problems}")
