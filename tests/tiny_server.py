"""The bundled tiny model served in-process on loopback, and what `record` sees for the same prompts, shared by
the tests that compare a server's answers with a recording (test_server_routed_experts.py,
test_trace_capture.py) through the session fixtures ``tiny_server`` and ``tiny_recorded`` of conftest.py.

A recording is greedy with one prompt per batch, so a prompt's rows are its own routing whatever the server
batches it with (the tiny model is batch-invariant: benchmarks/batch_invariance.py)."""

from __future__ import annotations

PROMPTS = [f"question {i}: tell me about {word}." for i, word in enumerate(
    ["caches", "the sea", "Rome", "lists", "the sky", "poems", "experts", "memory", "trees", "sorting",
     "models", "routers", "tokens", "layers", "GPUs", "disks"])]
NEW_TOKENS = 4


def serving():
    """A context manager: a ServerThread of the tiny model (fast tier 30%, LRU, batches of up to 16)."""
    from contextlib import contextmanager

    from moe_offload.api import load
    from moe_offload.server import ServerThread

    @contextmanager
    def running():
        with load("tiny", fast_budget="30%", policy="lru", max_batch=16) as engine:
            with ServerThread(engine, "tiny") as server:
                yield server

    return running()


def recorded_alone():
    """Each of PROMPTS's routing as `record` writes it (NEW_TOKENS new tokens): int64 [rows, L, K] per prompt."""
    import numpy as np

    from moe_offload.models.recorder import record
    from moe_offload.models.tiny import load as load_model
    from moe_offload.text.prompts import Prompt

    model, adapter, tokenizer = load_model("tiny")
    trace = record(model, adapter, tokenizer, [Prompt(p, f"t:{i}") for i, p in enumerate(PROMPTS)],
                   model_name="tiny", max_new_tokens=NEW_TOKENS, batch_size=1).trace
    return [trace.experts[trace.request == r].astype(np.int64) for r in range(len(PROMPTS))]
