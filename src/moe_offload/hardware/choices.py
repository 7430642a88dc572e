"""The runtime's choices that a hardware profile's ``[runtime]`` table names: compute dtypes, stored expert
dtypes (and which are quantized) and the forms of a quantized expert in the fast tier.

The tables live here, at the lowest layer that checks them (hardware/profile.py reads a profile without
importing the runtime or PyTorch); the runtime modules that implement each choice and the CLI import them from
here, so every layer checks one table.
"""

from __future__ import annotations

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")  # the fast tier's dtype (runtime/engine_setup.py)
EXPERT_DTYPES = ("float16", "bfloat16", "int8", "int4")  # the experts as packed (runtime/quantize.py)
QUANTIZED = {"int8": 127, "int4": 7}  # quantized expert dtype -> the largest |q| (runtime/quantize.py)
EXPERT_FORMS = ("per-use", "on-arrival", "kernel")  # a quantized expert in the fast tier (runtime/expert_forms.py)
EXPERT_COMPUTE = ("auto",) + EXPERT_FORMS  # what --expert-compute accepts
