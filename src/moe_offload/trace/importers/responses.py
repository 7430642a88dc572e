"""Reading saved OpenAI-compatible responses and decoding the routing arrays engines put in them.

A response file is a JSON document (one response object, or a list of them) or JSON lines (one response
per line); responses are numbered from 0 in file order, and every error names the file, the response and
the problem. Routing arrays come in the encodings the engines use:

* nested JSON lists ``[tokens][layers][top_k]`` (vLLM's ``prompt_routed_experts``/``routed_experts``);
* ``{"encoding": "base64", "dtype": ..., "shape": [...], "data": ...}`` (vLLM's compact form);
* a base64 string of a ``.npy`` file (vLLM's ``routed_experts`` in releases that return the whole sequence);
* a base64 string of raw little-endian int32 ids (SGLang's ``routed_experts``), reshaped by the caller.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from pathlib import Path

import numpy as np

from moe_offload.errors import TraceError
from moe_offload.inputs import parse_json, read_text

ID_DTYPES = {"int16", "int32", "int64", "uint8", "uint16", "uint32"}


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
        document = json.loads(text)
    except ValueError:  # JSON lines: parsed line by line so that an error names its line
        responses = [parse_json(line, path, "response", TraceError, row=number, unit="line")
                     for number, line in enumerate(text.split("\n"), start=1) if line.strip()]
    else:
        responses = document if isinstance(document, list) else [document]
    if not responses:
        raise TraceError(path, "no responses (an empty list)")
    for index, response in enumerate(responses):
        if not isinstance(response, dict):
            raise ResponseError(path, index, f"expected a response object, found {type(response).__name__}")
    return responses


def decode_nested_or_encoded(value, path: Path, index: int, field: str) -> np.ndarray:
    """A vLLM routing array [tokens, layers, top_k] (int64) from any of its encodings."""
    if isinstance(value, dict):
        missing = [key for key in ("encoding", "dtype", "shape", "data") if key not in value]
        if missing:
            raise ResponseError(path, index, f"{field}: an encoded array needs {', '.join(missing)}")
        if value["encoding"] != "base64" or value["dtype"] not in ID_DTYPES:
            raise ResponseError(path, index, f"{field}: encoding {value['encoding']!r} of dtype {value['dtype']!r} "
                                             f"is not base64 of integer ids")
        raw = b64decode(value["data"], path, index, field)
        dtype = np.dtype(value["dtype"]).newbyteorder("<")
        if len(raw) % dtype.itemsize:
            raise ResponseError(path, index, f"{field}: {len(raw)} bytes is not a whole number of {value['dtype']}")
        ids = np.frombuffer(raw, dtype=dtype)
        shape = value["shape"]
        if (not isinstance(shape, list) or len(shape) != 3 or not all(isinstance(s, int) and s >= 0 for s in shape)
                or int(np.prod(shape)) != ids.size):
            raise ResponseError(path, index, f"{field}: shape {shape!r} does not hold the {ids.size} ids sent")
        return ids.reshape(shape).astype(np.int64)
    if isinstance(value, str):
        raw = b64decode(value, path, index, field)
        if not raw.startswith(b"\x93NUMPY"):
            raise ResponseError(path, index, f"{field}: the base64 text is not a NumPy .npy array")
        try:
            array = np.load(io.BytesIO(raw), allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise ResponseError(path, index, f"{field}: not a readable .npy array ({exc})") from None
        return check_id_array(array, path, index, field)
    if isinstance(value, list):
        try:
            array = np.asarray(value)
        except ValueError:
            raise ResponseError(path, index, f"{field}: the nested lists are ragged, not [tokens][layers][top_k]") \
                from None
        if array.size == 0:
            return np.zeros((0, 0, 0), np.int64)
        return check_id_array(array, path, index, field)
    raise ResponseError(path, index, f"{field}: expected a list, an encoded array or base64 text, "
                                     f"not {type(value).__name__}")


def check_id_array(array: np.ndarray, path, index: int, field: str, unit: str = "response") -> np.ndarray:
    """``array`` as int64 ids [tokens, layers, top_k]; TraceError naming the response (or ``unit``) else."""
    if array.ndim != 3:
        raise TraceError(path, f"{field}: shape {list(array.shape)} is not [tokens, layers, top_k]", row=index,
                         unit=unit)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.integer):
        raise TraceError(path, f"{field}: expert ids must be integers, not {array.dtype}", row=index, unit=unit)
    return array.astype(np.int64)


def b64decode(text, path, index: int, field: str) -> bytes:
    if not isinstance(text, str):
        raise ResponseError(path, index, f"{field}: expected base64 text, not {type(text).__name__}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ResponseError(path, index, f"{field}: not valid base64 ({exc})") from None


def decode_int32_ids(text, path, index: int, field: str) -> np.ndarray:
    """SGLang's encoding: base64 of little-endian int32 ids, flat."""
    raw = b64decode(text, path, index, field)
    if len(raw) % 4:
        raise ResponseError(path, index, f"{field}: {len(raw)} bytes is not a whole number of int32 ids")
    return np.frombuffer(raw, dtype="<i4").astype(np.int64)


def usage_counts(response: dict, path, index: int) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) of the response's ``usage`` (None where absent)."""
    usage = response.get("usage") or {}
    if not isinstance(usage, dict):
        raise ResponseError(path, index, f"usage must be an object, not {type(usage).__name__}")
    counts = []
    for key in ("prompt_tokens", "completion_tokens"):
        value = usage.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ResponseError(path, index, f"usage.{key} must be a non-negative integer, not {value!r}")
        counts.append(value)
    return counts[0], counts[1]
