"""Writers of the engines' routing formats from a trace, for the round-trip tests: each request of the trace
becomes one response as vLLM or SGLang would send it (the prompt's rows, the generated rows, and usage
counting one more generated token than went through the model, as the engines count it)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np

from moe_offload.trace.format import PREFILL, Trace


def requests_of(trace: Trace) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt rows, generated rows) of each request, in request-id order, rows in position order."""
    result = []
    for request in np.unique(trace.request):
        rows = np.flatnonzero(trace.request == request)
        rows = rows[np.argsort(trace.position[rows], kind="stable")]
        prefill = trace.phase[rows] == PREFILL
        experts = trace.experts[rows].astype(np.int64)
        result.append((experts[prefill], experts[~prefill]))
    return result


def npy_base64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def vllm_responses(trace: Trace, model: str = "m", encoding: str = "lists", dtype: str = "int16") -> list[dict]:
    """``lists``: prompt_routed_experts + choices[0].routed_experts as nested lists (vLLM 0.21);
    ``npy``: the whole sequence in choices[0].routed_experts as base64 of a .npy of ``dtype`` (the current
    releases: uint8, uint16 or int32); ``envelope``: the same as {encoding, dtype, shape, data}."""
    responses = []
    for prompt, generated in requests_of(trace):
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(generated) + 1}
        choice = {"index": 0, "text": "x", "finish_reason": "length"}
        response = {"id": "cmpl", "object": "text_completion", "model": model, "choices": [choice], "usage": usage}
        if encoding == "lists":
            response["prompt_routed_experts"] = prompt.tolist()
            choice["routed_experts"] = generated.tolist()
        elif encoding == "npy":
            choice["routed_experts"] = npy_base64(np.concatenate([prompt, generated]).astype(dtype))
        else:
            ids = np.concatenate([prompt, generated]).astype(np.dtype(dtype).newbyteorder("<"))
            choice["routed_experts"] = {"encoding": "base64", "dtype": dtype, "shape": list(ids.shape),
                                        "data": base64.b64encode(ids.tobytes()).decode()}
        responses.append(response)
    return responses


def sglang_responses(trace: Trace, model: str = "m", dtype: str = "<i4") -> list[dict]:
    """SGLang's encoding: base64 of raw little-endian ids (int32 released; uint16, uint8 proposed)."""
    responses = []
    for prompt, generated in requests_of(trace):
        ids = np.concatenate([prompt, generated]).astype(dtype)
        choice = {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length",
                  "sgl_ext": {"routed_experts": base64.b64encode(ids.tobytes()).decode()}}
        responses.append({"id": "chatcmpl", "object": "chat.completion", "model": model, "choices": [choice],
                          "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(generated) + 1}})
    return responses


def model_config(trace: Trace) -> dict:
    meta = trace.meta
    return {"model_type": "mixtral", "num_hidden_layers": meta.num_layers, "num_local_experts": meta.num_experts,
            "num_experts_per_tok": meta.top_k, "hidden_size": 4, "intermediate_size": 8, "torch_dtype": "float32"}


def write_jsonl(path, responses: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in responses))


def interleaved_order(trace: Trace) -> np.ndarray:
    """The rows of ``trace`` in the order a continuous-batching server runs its requests when request r (by
    id order) joins at forward pass r: prompt at pass r, the i-th generated token at pass r + 1 + i (r + i
    without a prompt); within a pass, requests in id order. Written independently of the importer."""
    keys = []
    for rank, request in enumerate(np.unique(trace.request)):
        rows = np.flatnonzero(trace.request == request)
        rows = rows[np.argsort(trace.position[rows], kind="stable")]
        has_prompt = bool((trace.phase[rows] == PREFILL).any())
        generated = 0
        for row in rows:
            if trace.phase[row] == PREFILL:
                keys.append((rank, rank, int(trace.position[row]), int(row)))
            else:
                keys.append((rank + generated + (1 if has_prompt else 0), rank, int(trace.position[row]), int(row)))
                generated += 1
    keys.sort()
    return np.asarray([key[-1] for key in keys])
