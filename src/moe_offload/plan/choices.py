"""The names a plan chooses from that the runtime defines: compute dtypes, stored expert dtypes, expert forms,
batch arithmetic and where fMoE's matcher searches. They live here, below the runtime, so that a plan (and
the hardware profile's ``[runtime]`` table) is checked without importing the runtime or PyTorch; the runtime
modules that implement each choice import its table from here."""

from __future__ import annotations

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")  # the fast tier's dtype (runtime/engine_setup.py)
EXPERT_DTYPES = ("float16", "bfloat16", "int8", "int4")  # the experts as packed (runtime/quantize.py)
EXPERT_FORMS = ("per-use", "on-arrival", "kernel")  # how the fast tier holds quantized experts (expert_forms.py)
EXPERT_COMPUTE = ("auto",) + EXPERT_FORMS
BATCH_MATH = ("exact", "fast")  # runtime/packed.py
MATCHERS = ("async", "inline", "lockstep")  # runtime/matcher.py
REPLAY_WEIGHTS = ("trace", "router")  # runtime/replay.py
