"""Reading saved OpenAI-compatible responses and decoding the routing arrays engines put in them.

A response file is a JSON document (one response object, or a list of them) or JSON lines (one response
per line); responses are numbered from 0 in file order, and every error names the file, the response and
the problem, quoting at most a few hundred bytes of what it found. Routing arrays come in every encoding the
engines have released:

* nested JSON lists ``[tokens][layers][top_k]`` (vLLM up to v0.21's ``prompt_routed_experts`` and
  ``routed_experts``, int16 ids);
* ``{"encoding": "base64", "dtype": ..., "shape": [...], "data": ...}`` (a compact form of the same);
* base64 of a ``.npy`` file: vLLM's choice ``routed_experts`` now (``vllm/entrypoints/openai/completion/
  protocol.py``: shape ``[tokens - 1, layers, top_k]``, dtype uint8, uint16 or int32, decoded with
  ``np.load(io.BytesIO(base64.b64decode(s)))``), read through :mod:`.arrays` so that its header is
  checked before anything is allocated;
* base64 of raw little-endian ids without a header: SGLang's ``routed_experts`` (int32, the released
  encoding; uint16 and uint8 in a proposed change), returned flat as bytes for the caller to shape from
  the model's config (engines.py).

``-1`` is a missing route (vLLM's prefix-cached positions whose routing was not kept; SGLang-JAX's layers
without routed experts; NeMo RL's ``R3_MISSING_ROUTE_SENTINEL``): the decoders keep it, engines.py decides.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_offload.errors import TraceError
from moe_offload.inputs import parse_json, read_text
from moe_offload.trace.importers.arrays import DEFAULT_MAX_ARRAY_BYTES, read_npy
from moe_offload.trace.importers.common import quote

# A request's token count past this does not fit the trace's int32 positions.
MAX_TOKENS = 2**31 - 1
ID_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")


class ResponseError(TraceError):
    """A problem with response ``index`` of ``path``."""

    def __init__(self, path, index: int, problem: str):
        super().__init__(path, problem, row=index, unit="response")


def read_responses(path: Path) -> list[dict]:
    """Every response object of a saved JSON or JSON-lines file, in file order."""
    text = read_text(path, "response file", TraceError)
    if not text.strip():
        raise TraceError(path, "no responses (the file is empty)")
    try:  # one document (a response, or a list of them), pretty-printed or not
        json.loads(text)
    except RecursionError:
        raise TraceError(path, "JSON nested too deeply to be a response file") from None
    except ValueError:  # JSON lines: parsed line by line so that an error names its line
        responses = [parse_json(line, path, "response", TraceError, row=number, unit="line")
                     for number, line in enumerate(text.split("\n"), start=1) if line.strip()]
    else:
        document = parse_json(text, path, "response file", TraceError)  # refuses NaN and overflowing numbers
        responses = document if isinstance(document, list) else [document]
    if not responses:
        raise TraceError(path, "no responses (an empty list)")
    for index, response in enumerate(responses):
        if not isinstance(response, dict):
            raise ResponseError(path, index, f"expected a response object, found {type(response).__name__}")
    return responses


def field_object(holder: dict, key: str, path, index: int, name: str) -> dict | None:
    """``holder[key]`` when it is an object, None when absent or null; ResponseError for anything else."""
    value = holder.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ResponseError(path, index, f"{name} must be an object, not {type(value).__name__} {quote(value)}")
    return value


def decode_routing(value, path, index: int, field: str,
                   max_bytes: int = DEFAULT_MAX_ARRAY_BYTES) -> np.ndarray | bytes:
    """A routing array [tokens, layers, top_k] (int64, -1 kept) from the encodings that carry a shape, or the
    raw bytes of flat ids (SGLang's encoding) for the caller to shape."""
    if isinstance(value, list):
        return _nested(value, path, index, field)
    if isinstance(value, dict):
        return _envelope(value, path, index, field, max_bytes)
    if isinstance(value, str):
        raw = b64decode(value, path, index, field)
        if raw.startswith(b"\x93NUMPY"):
            return check_id_array(read_npy(raw, path, field, max_bytes, row=index), path, index, field)
        return raw
    raise ResponseError(path, index, f"{field}: expected a list, an encoded array or base64 text, not "
                                     f"{type(value).__name__} {quote(value)}")


def _nested(value: list, path, index: int, field: str) -> np.ndarray:
    if not value:
        return np.zeros((0, 0, 0), np.int64)
    try:
        array = np.array(value)
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise ResponseError(path, index, f"{field}: the nested lists are not [tokens][layers][top_k] integer ids "
                                         f"(ragged, or nested too deeply): {quote(value)}") from None
    return check_id_array(array, path, index, field)


def _envelope(value: dict, path, index: int, field: str, max_bytes: int) -> np.ndarray:
    missing = [key for key in ("encoding", "dtype", "shape", "data") if key not in value]
    if missing:
        raise ResponseError(path, index, f"{field}: an encoded array needs {', '.join(missing)}")
    encoding, dtype_name, shape = value["encoding"], value["dtype"], value["shape"]
    if encoding != "base64" or not isinstance(dtype_name, str) or dtype_name not in ID_DTYPES:
        raise ResponseError(path, index, f"{field}: encoding {quote(encoding)} of dtype {quote(dtype_name)} is not "
                                         f"base64 of integer ids ({', '.join(ID_DTYPES)})")
    if not (isinstance(shape, list) and len(shape) == 3
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
        raise ResponseError(path, index, f"{field}: shape {quote(shape)} is not three non-negative integers "
                                         "[tokens, layers, top_k]")
    dtype = np.dtype(dtype_name).newbyteorder("<")
    declared = math.prod(shape) * dtype.itemsize  # Python integers: no overflow
    if declared > max_bytes:
        raise ResponseError(path, index, f"{field}: shape {shape} of {dtype_name} is {declared:,} bytes, more than "
                                         f"the {max_bytes:,} an import decodes (--max-array-bytes raises the limit)")
    raw = b64decode(value["data"], path, index, field)
    if len(raw) != declared:
        raise ResponseError(path, index, f"{field}: shape {shape} of {dtype_name} is {declared:,} bytes, but the "
                                         f"data holds {len(raw):,}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).astype(np.int64)


def check_id_array(array: np.ndarray, path, index: int | None, field: str, unit: str = "response") -> np.ndarray:
    """``array`` as int64 ids [tokens, layers, top_k]; TraceError naming the response (or ``unit``) else."""
    if array.ndim != 3:
        raise TraceError(path, f"{field}: shape {list(array.shape)} is not [tokens, layers, top_k]", row=index,
                         unit=unit)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.integer):
        raise TraceError(path, f"{field}: expert ids must be integers, not {array.dtype}", row=index, unit=unit)
    if array.dtype == np.uint64 and array.size and int(array.max()) >= 2**63:
        raise TraceError(path, f"{field}: expert id {int(array.max())} is not an expert id", row=index, unit=unit)
    return array.astype(np.int64)


def b64decode(text, path, index: int, field: str) -> bytes:
    if not isinstance(text, str):
        raise ResponseError(path, index, f"{field}: expected base64 text, not {type(text).__name__} {quote(text)}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ResponseError(path, index, f"{field}: not valid base64 ({quote(str(exc))})") from None


@dataclass(frozen=True)
class Usage:
    """What a response's ``usage`` says (None where absent): prompt and completion tokens, and how many of
    the prompt's first tokens the engine served from its prefix cache (``prompt_tokens_details.cached_tokens``,
    the OpenAI field vLLM and SGLang fill)."""

    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int = 0


def usage_of(response: dict, path, index: int, holder: dict | None = None, name: str = "usage") -> Usage:
    """The :class:`Usage` of ``holder`` (default: the response's ``usage`` object)."""
    usage = field_object(response, "usage", path, index, "usage") if holder is None else holder
    usage = usage or {}
    counts = [count(usage, key, path, index, f"{name}.{key}") for key in ("prompt_tokens", "completion_tokens")]
    details = field_object(usage, "prompt_tokens_details", path, index, f"{name}.prompt_tokens_details") or {}
    cached = count(details, "cached_tokens", path, index, f"{name}.prompt_tokens_details.cached_tokens") or 0
    if counts[0] is not None and cached > counts[0]:
        raise ResponseError(path, index, f"{name}.prompt_tokens_details.cached_tokens={cached} exceeds the "
                                         f"{counts[0]} prompt tokens")
    return Usage(counts[0], counts[1], cached)


def count(holder: dict, key: str, path, index: int, name: str) -> int | None:
    """``holder[key]`` as a non-negative integer (None when absent or null); ``true`` is not 1."""
    value = holder.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOKENS:
        raise ResponseError(path, index, f"{name} must be an integer from 0 to {MAX_TOKENS:,}, not {quote(value)}")
    return value
