"""SGLang's ``routed_experts`` extension, as the server returns it.

A request with ``"return_routed_experts": true`` gets, on its choice (the last chunk of a stream),
``"sgl_ext": {"routed_experts": BASE64}``: base64 of little-endian int32 expert ids, logical shape
``[tokens, num_moe_layers, top_k]``, the rows of the tokens the model ran, positions
``[routed_experts_start_len, prompt + completion - 1)`` (the last generated token is never fed back),
each layer's experts in the router's rank order. That is SGLang's encoding (its
``--enable-return-routed-experts`` server flag is implied here), so clients and importers written for
SGLang read ours: ``moe-offload trace import sglang`` and ``trace capture`` among them.

Beside it, in the server's own ``moe_offload`` extension, ``passes``: the numbers of the engine's forward
passes the request ran in (its prompt in the first, each fed token in one of the next), so that a capture
can rebuild the batches the server really ran (trace/capture.py).
"""

from __future__ import annotations

import base64

import numpy as np


def attach(body: dict, completion, start_len: int) -> None:
    """Add a Completion's routing to a response ``body`` (or a stream's last chunk), when it was asked."""
    if completion.routed_experts is None:
        return
    body["choices"][0]["sgl_ext"] = sgl_ext(completion.routed_experts, start_len)
    body.setdefault("moe_offload", {})["passes"] = list(completion.passes)


def sgl_ext(routed_experts: np.ndarray, start_len: int = 0) -> dict:
    """The ``sgl_ext`` object of a choice from a Completion's ``routed_experts`` [tokens, L, K]."""
    rows = np.ascontiguousarray(routed_experts[start_len:], dtype="<i4")
    return {"routed_experts": base64.b64encode(rows.tobytes()).decode("ascii")}
