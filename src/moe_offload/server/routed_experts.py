"""SGLang's ``routed_experts`` extension, as the server returns it.

A request with ``"return_routed_experts": true`` gets, on its choice (the last chunk of a stream),
``"sgl_ext": {"routed_experts": BASE64}``: base64 of little-endian int32 expert ids, logical shape
``[tokens, num_moe_layers, top_k]``, the rows of the tokens the model ran, positions
``[routed_experts_start_len, prompt + completion - 1)`` (the last generated token is never fed back),
each layer's experts in the router's rank order. That is SGLang's encoding (its
``--enable-return-routed-experts`` server flag is implied here), so clients and importers written for
SGLang read ours: ``moe-offload trace import sglang`` and ``trace capture`` among them.
"""

from __future__ import annotations

import base64

import numpy as np


def sgl_ext(routed_experts: np.ndarray, start_len: int = 0) -> dict:
    """The ``sgl_ext`` object of a choice from a Completion's ``routed_experts`` [tokens, L, K]."""
    rows = np.ascontiguousarray(routed_experts[start_len:], dtype="<i4")
    return {"routed_experts": base64.b64encode(rows.tobytes()).decode("ascii")}
