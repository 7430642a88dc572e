"""Importers of the routing that serving engines return: vLLM, SGLang, and plain NumPy arrays.

``vllm`` (a server started with ``--enable-return-routed-experts``)
    Saved OpenAI responses, completions or chat (a JSON file, or JSON lines). Releases since the aux-output
    connector return each choice's ``routed_experts`` as base64 of a ``.npy`` (uint8, uint16 or int32) of
    shape ``[prompt + completion - 1 - S, layers, top_k]``, S the request's ``routed_experts_prompt_start``
    (``vllm/entrypoints/openai/completion/protocol.py``); v0.21 returned nested int16 lists, the prompt's
    rows as ``prompt_routed_experts`` on the response and each choice's generated rows in its
    ``routed_experts`` (vLLM's routed-experts replay guide, under docs/training in its repository). Both are read, and any encoding
    of :mod:`.responses` in either field. Offline outputs saved with NumPy are ``.npz`` files, one request
    each: ``routed_experts`` with either ``prompt_routed_experts`` or ``num_prompt_tokens`` (where the
    prompt's rows end), and optionally ``num_cached_tokens`` (``RequestOutput.num_cached_tokens``).

``sglang`` (``--enable-return-routed-experts`` and ``"return_routed_experts": true`` in the request)
    Saved OpenAI responses whose choices carry ``sgl_ext.routed_experts`` (or the response
    ``sglext.routed_experts``, or a ``/generate`` response's ``meta_info.routed_experts``): base64 of
    little-endian ids, int32 in the released code (uint16 or uint8 in a proposed change, told apart by
    which one gives the rows the usage counts), logical shape ``[tokens, layers, top_k]``. The ids carry
    no shape, so L and K come from the model's config (``--model-config``); an engine that reports every
    decoder layer (SGLang-JAX, with ``-1`` in the dense ones) is cut to the MoE layers. The rows are the
    tokens that went through the model: positions ``[routed_experts_start_len, prompt + completion - 1)``.

``npy``
    Plain integer arrays ``[tokens, layers, top_k]``: a ``.npy`` per request, or an ``.npz`` holding one
    array per request (in stored order). Every row is a decode token of its own iteration.

A response with fewer rows than ``prompt + completion - 1`` was asked from a later start: its first prompt
positions are missing, and counted. Prompt positions served from the prefix cache are dropped and counted
(engine_trace.py says how, and ``keep_cached_prompt`` keeps them). Several responses are several requests
(one per choice), in the order of their ``created`` times where every response has one, else in file
order, interleaved as a continuous-batching server runs them (:func:`.engine_trace.schedule`). One file
holds one model's responses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from moe_offload.errors import ConfigError, TraceError
from moe_offload.trace.format import Trace
from moe_offload.trace.importers.arrays import DEFAULT_MAX_ARRAY_BYTES, read_npy_file, read_npz
from moe_offload.trace.importers.common import _as_paths, _check_num_experts, quote
from moe_offload.trace.importers.engine_trace import ChoiceRouting, Routed, build_trace
from moe_offload.trace.importers.model_config import ModelShape
from moe_offload.trace.importers.responses import (MAX_TOKENS, ResponseError, Usage, check_id_array, count,
                                                   decode_routing, field_object, read_responses, usage_of)

# SGLang's raw ids: the released int32, then the proposed uint16 and uint8 (engines.py's docstring)
# The servers ``trace capture`` asks for routed experts (trace/capture.py): this project's, and the two engines
# whose answers are read here.
CAPTURE_ENGINES = ("moe-offload", "sglang", "vllm")
RAW_ID_DTYPES = ("<i4", "<u2", "u1")


def import_vllm(paths, *, num_experts: int | None = None, model: str | None = None, expert_bytes: int | None = None,
                hidden_size: int | None = None, source: str | None = None, license: str | None = None,
                extra: dict | None = None, model_config: ModelShape | None = None, keep_cached_prompt: bool = False,
                max_array_bytes: int = DEFAULT_MAX_ARRAY_BYTES, on_file: Callable[[], None] | None = None) -> Trace:
    """Import vLLM responses (``.json``/``.jsonl``) and offline outputs (``.npz``)."""
    def read(path: Path) -> list[Routed]:
        if path.suffix.lower() == ".npz":
            return [Routed(None, path, 0, _vllm_offline(path, model_config, max_array_bytes))]
        return _each_response(path, lambda response, where, index: vllm_rows(
            response, where, index, shape=model_config, max_array_bytes=max_array_bytes))
    return _import("vllm", paths, read, num_experts, model, expert_bytes, hidden_size, source, license, extra,
                   model_config, keep_cached_prompt, on_file)


def import_sglang(paths, *, num_experts: int | None = None, model: str | None = None,
                  expert_bytes: int | None = None, hidden_size: int | None = None, source: str | None = None,
                  license: str | None = None, extra: dict | None = None, model_config: ModelShape | None = None,
                  keep_cached_prompt: bool = False, max_array_bytes: int = DEFAULT_MAX_ARRAY_BYTES,
                  on_file: Callable[[], None] | None = None) -> Trace:
    """Import SGLang responses; ``model_config`` is required (the ids are flat)."""
    if model_config is None:
        raise ConfigError("sglang routing is a flat list of ids without its shape: give the model's config "
                          "(--model-config config.json) for its layers and top-k")
    def read(path: Path) -> list[Routed]:
        return _each_response(path, lambda response, where, index: sglang_rows(
            response, where, index, shape=model_config, max_array_bytes=max_array_bytes))
    return _import("sglang", paths, read, num_experts, model, expert_bytes, hidden_size, source, license, extra,
                   model_config, keep_cached_prompt, on_file)


def import_npy(paths, *, num_experts: int | None = None, model: str | None = None, expert_bytes: int | None = None,
               hidden_size: int | None = None, source: str | None = None, license: str | None = None,
               extra: dict | None = None, model_config: ModelShape | None = None,
               max_array_bytes: int = DEFAULT_MAX_ARRAY_BYTES, on_file: Callable[[], None] | None = None) -> Trace:
    """Import plain ``[tokens, layers, top_k]`` arrays, every row a decode token."""
    def read(path: Path) -> list[Routed]:
        return [Routed(None, path, number, ChoiceRouting(array, 0, 0))
                for number, array in enumerate(_arrays(path, max_array_bytes))]
    return _import("npy", paths, read, num_experts, model, expert_bytes, hidden_size, source, license, extra,
                   model_config, False, on_file)


# ------------------------------------------------------------------------------------------------------ vLLM

def vllm_rows(response: dict, path, index: int, shape: ModelShape | None = None,
              max_array_bytes: int = DEFAULT_MAX_ARRAY_BYTES) -> list[ChoiceRouting]:
    """The routing of each choice of one vLLM response."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ResponseError(path, index, "no choices: is this an OpenAI response?")
    usage = usage_of(response, path, index)
    prompt_field = response.get("prompt_routed_experts")
    prompt = None
    if prompt_field is not None:
        prompt = _shaped(decode_routing(prompt_field, path, index, "prompt_routed_experts", max_array_bytes),
                         shape, None, path, index, "prompt_routed_experts")
        if usage.prompt_tokens is not None and len(prompt) != usage.prompt_tokens:
            raise ResponseError(path, index, f"prompt_routed_experts has {len(prompt)} rows, but usage.prompt_tokens "
                                             f"is {usage.prompt_tokens}")
    result = []
    for number, choice in enumerate(choices):
        field = f"choices[{number}].routed_experts"
        if not isinstance(choice, dict):
            raise ResponseError(path, index, f"choices[{number}] must be an object, not {type(choice).__name__}")
        value = choice.get("routed_experts")
        if prompt is None:  # the whole sequence in the choice (the current releases)
            if value is None:
                raise ResponseError(path, index, f"no routing: neither prompt_routed_experts nor {field} (start "
                                                 "vLLM with --enable-return-routed-experts)")
            rows = _shaped(decode_routing(value, path, index, field, max_array_bytes), shape,
                           _expected_rows(usage), path, index, field)
            result.append(_placed(rows, usage, path, index, field))
            continue
        generated = (np.zeros((0,) + prompt.shape[1:], np.int64) if value is None else
                     _shaped(decode_routing(value, path, index, field, max_array_bytes), shape, None, path, index,
                             field))
        if generated.size and prompt.size and generated.shape[1:] != prompt.shape[1:]:
            raise ResponseError(path, index, f"{field} has shape {list(generated.shape)}, but the prompt's rows "
                                             f"have {list(prompt.shape[1:])} layers x top-k")
        completion = usage.completion_tokens
        if len(choices) == 1 and completion is not None and len(generated) not in (completion, completion - 1):
            raise ResponseError(path, index, f"{field} has {len(generated)} rows for {completion} generated tokens")
        rows = np.concatenate([r for r in (prompt, generated) if r.size] or [prompt])
        result.append(ChoiceRouting(rows, 0, len(prompt), usage.cached_tokens))
    return result


def _vllm_offline(path: Path, shape: ModelShape | None, max_array_bytes: int) -> ChoiceRouting:
    arrays = read_npz(path, max_array_bytes)
    if "routed_experts" not in arrays:
        raise TraceError(path, f"no 'routed_experts' array (found {quote(sorted(arrays))})")
    routed = _shaped(check_id_array(arrays["routed_experts"], path, None, "routed_experts"), shape, None, path, 0,
                     "routed_experts")
    cached = _scalar(arrays, "num_cached_tokens", path, MAX_TOKENS) or 0
    if "prompt_routed_experts" in arrays:
        prompt = _shaped(check_id_array(arrays["prompt_routed_experts"], path, None, "prompt_routed_experts"), shape,
                         None, path, 0, "prompt_routed_experts")
        if prompt.size and routed.size and prompt.shape[1:] != routed.shape[1:]:
            raise TraceError(path, f"prompt_routed_experts has {list(prompt.shape[1:])} layers x top-k, "
                                   f"routed_experts {list(routed.shape[1:])}")
        rows = np.concatenate([r for r in (prompt, routed) if r.size] or [prompt])
        split = len(prompt)
    else:
        split = _scalar(arrays, "num_prompt_tokens", path, len(routed))
        if split is None:
            raise TraceError(path, "the prompt/generation split is missing: save 'prompt_routed_experts' or "
                                   "'num_prompt_tokens' beside 'routed_experts'")
        rows = routed
    if cached > split:
        raise TraceError(path, f"num_cached_tokens={cached} exceeds the {split} prompt tokens")
    return ChoiceRouting(rows, 0, split, cached)


def _scalar(arrays: dict, name: str, path: Path, high: int) -> int | None:
    if name not in arrays:
        return None
    value = arrays[name]
    if value.shape != () or value.dtype == bool or not np.issubdtype(value.dtype, np.integer) \
            or not 0 <= int(value) <= high:
        raise TraceError(path, f"{name} must be one integer within 0..{high}, not {quote(value)}")
    return int(value)


# ---------------------------------------------------------------------------------------------------- SGLang

def sglang_rows(response: dict, path, index: int, shape: ModelShape,
                max_array_bytes: int = DEFAULT_MAX_ARRAY_BYTES) -> list[ChoiceRouting]:
    """The routing of each choice of one SGLang response (or /generate answer)."""
    usage = usage_of(response, path, index)
    choices = response.get("choices")
    if isinstance(choices, list) and choices:
        extension = field_object(response, "sglext", path, index, "sglext") or {}
        top_level = extension.get("routed_experts") if len(choices) == 1 else None
        encoded, fields = [], []
        for number, choice in enumerate(choices):
            if not isinstance(choice, dict):
                raise ResponseError(path, index, f"choices[{number}] must be an object, not "
                                                 f"{type(choice).__name__}")
            own = field_object(choice, "sgl_ext", path, index, f"choices[{number}].sgl_ext") or {}
            encoded.append(own.get("routed_experts") or top_level)
            fields.append(f"choices[{number}].sgl_ext.routed_experts")
    elif response.get("meta_info") is not None:  # the native /generate endpoint
        meta = field_object(response, "meta_info", path, index, "meta_info")
        encoded, fields = [meta.get("routed_experts")], ["meta_info.routed_experts"]
        native = usage_of(response, path, index, holder=meta, name="meta_info")
        usage = Usage(_either(native.prompt_tokens, usage.prompt_tokens),
                      _either(native.completion_tokens, usage.completion_tokens),
                      native.cached_tokens or usage.cached_tokens)
        cached = count(meta, "cached_tokens", path, index, "meta_info.cached_tokens")  # /generate's own field
        if cached is not None:
            usage = Usage(usage.prompt_tokens, usage.completion_tokens, cached)
    else:
        raise ResponseError(path, index, "no choices: is this an OpenAI response?")
    if usage.prompt_tokens is None or usage.completion_tokens is None:
        raise ResponseError(path, index, "usage.prompt_tokens and usage.completion_tokens are needed to split "
                                         "the prompt's rows from the generated ones")
    if usage.cached_tokens > usage.prompt_tokens:
        raise ResponseError(path, index, f"cached_tokens={usage.cached_tokens} exceeds the {usage.prompt_tokens} "
                                         "prompt tokens")
    result = []
    for value, field in zip(encoded, fields):
        if value is None:
            raise ResponseError(path, index, f"no routing: {field} is missing (start SGLang with "
                                             "--enable-return-routed-experts and send return_routed_experts: true)")
        rows = _shaped(decode_routing(value, path, index, field, max_array_bytes), shape, _expected_rows(usage),
                       path, index, field)
        result.append(_placed(rows, usage, path, index, field))
    return result


def _either(first, second):
    return first if first is not None else second


# ---------------------------------------------------------------------------------------------------- shared

def _expected_rows(usage: Usage) -> int | None:
    """The rows a response routes from position 0: every token but the last generated one (never fed back)."""
    if usage.prompt_tokens is None or usage.completion_tokens is None:
        return None
    return max(usage.prompt_tokens + usage.completion_tokens - 1, 0)


def _placed(rows: np.ndarray, usage: Usage, path, index: int, field: str) -> ChoiceRouting:
    """The rows placed in their sequence: fewer than expected means the request asked from a later start."""
    if usage.prompt_tokens is None:
        raise ResponseError(path, index, f"{field} holds the whole sequence, but usage.prompt_tokens (where the "
                                         "prompt ends) is missing")
    expected = _expected_rows(usage)
    if expected is None:
        start = 0
    elif len(rows) > expected:
        raise ResponseError(path, index, f"{field}: {len(rows)} rows, more than the {expected} tokens (prompt + "
                                         "completion - 1) that went through the model")
    else:
        start = expected - len(rows)
    if start > usage.prompt_tokens:
        raise ResponseError(path, index, f"{field}: {len(rows)} rows, fewer than the "
                                         f"{expected - usage.prompt_tokens} generated tokens routed")
    return ChoiceRouting(rows, start, usage.prompt_tokens, usage.cached_tokens)


def _shaped(decoded, shape: ModelShape | None, expected_rows: int | None, path, index: int,
            field: str) -> np.ndarray:
    """Decoded routing as [rows, MoE layers, K]: raw flat ids shaped from the model's config (the dtype the
    usage's row count singles out, else the released int32), and the rows of an engine that reports every
    decoder layer cut to the MoE layers."""
    if isinstance(decoded, bytes):
        if shape is None:
            raise ResponseError(path, index, f"{field}: flat ids without a shape: give the model's config "
                                             "(--model-config config.json) for its layers and top-k")
        decoded = _raw_ids(decoded, shape, expected_rows, path, index, field)
    if shape is not None and decoded.size and decoded.shape[1] == shape.num_hidden_layers != shape.num_layers:
        decoded = decoded[:, list(shape.moe_layers)]
    return decoded


def _raw_ids(raw: bytes, shape: ModelShape, expected_rows: int | None, path, index: int, field: str) -> np.ndarray:
    K, L, H = shape.top_k, shape.num_layers, shape.num_hidden_layers
    candidates = []
    for dtype in RAW_ID_DTYPES:
        size = np.dtype(dtype).itemsize
        if len(raw) % size:
            continue
        ids = len(raw) // size
        for layers in dict.fromkeys((H, L)):
            if ids % (layers * K) == 0 and (expected_rows is None or ids // (layers * K) <= expected_rows):
                candidates.append((ids // (layers * K) != expected_rows, dtype, layers))
    if not candidates:
        raise ResponseError(path, index, f"{field}: {len(raw):,} bytes is not a whole number of int32 (or uint16, "
                                         f"uint8) ids of tokens of {L} layers x top-{K} (the model config's shape)"
                                         + (f", at most {expected_rows} tokens" if expected_rows is not None else ""))
    _, dtype, layers = min(candidates, key=lambda c: c[0])  # an exact row count first, else int32 (stable)
    return np.frombuffer(raw, dtype=dtype).astype(np.int64).reshape(-1, layers, K)


def _arrays(path: Path, max_array_bytes: int) -> list[np.ndarray]:
    if path.suffix.lower() == ".npz":
        arrays = list(read_npz(path, max_array_bytes).items())
    else:
        arrays = [("array", read_npy_file(path, max_array_bytes))]
    if not arrays:
        raise TraceError(path, "no arrays in the file")
    return [check_id_array(array, path, number, f"array {name!r}", unit="array")
            for number, (name, array) in enumerate(arrays)]


def _each_response(path: Path, rows_of) -> list[Routed]:
    """A Routed for every choice of every response of a file; arrival = the response's ``created``."""
    result = []
    for index, response in enumerate(read_responses(path)):
        created = response.get("created")
        created = created if isinstance(created, (int, float)) and not isinstance(created, bool) else None
        model = response.get("model")
        if model is not None and not isinstance(model, str):
            raise ResponseError(path, index, f"model must be a string, not {quote(model)}")
        for choice in rows_of(response, path, index):
            result.append(Routed(model, path, index, choice, created))
    return result


def _import(format_name: str, paths, read, num_experts, model, expert_bytes, hidden_size, source, license, extra,
            model_config: ModelShape | None, keep_cached_prompt: bool, on_file: Callable[[], None] | None) -> Trace:
    """The trace of the files ``paths``, read one at a time: what is kept of a file is its routing arrays, its
    JSON is dropped before the next file is read; ``on_file()`` is told when each file is done (a progress
    bar)."""
    paths = _as_paths(paths)
    _check_num_experts(num_experts)  # a bad option is refused before any file is read
    routed = []
    for path in paths:
        routed += read(path)
        if on_file is not None:
            on_file()
    return build_trace(format_name, routed, paths, num_experts=num_experts, model=model, expert_bytes=expert_bytes,
                       hidden_size=hidden_size, source=source, license=license, extra=extra,
                       model_config=model_config, keep_cached_prompt=keep_cached_prompt)
