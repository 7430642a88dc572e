"""The names a plan chooses from that only the runtime defines: batch arithmetic, where fMoE's matcher searches
and whose routing weights a replay uses. They live here, below the runtime, so that a plan is checked without
importing the runtime or PyTorch; the runtime modules that implement each choice import its table from here.
The dtypes and expert forms, which the hardware profile's ``[runtime]`` table checks too, live one layer lower
in hardware/choices.py."""

from __future__ import annotations

BATCH_MATH = ("exact", "fast")  # runtime/packed.py
MATCHERS = ("async", "inline", "lockstep")  # runtime/matcher.py
REPLAY_WEIGHTS = ("trace", "router")  # runtime/replay.py
