"""Importers of the routing that serving engines return: vLLM, SGLang, and plain NumPy arrays.

``vllm`` (a server started with ``--enable-return-routed-experts``)
    Saved OpenAI responses, completions or chat (a JSON file, or JSON lines). The prompt's routing is
    ``prompt_routed_experts`` at the response level, ``[prompt_tokens, layers, top_k]``, and each choice's
    ``routed_experts`` holds the generated tokens'. Releases that return the whole sequence in the
    choice's ``routed_experts`` alone (base64 of a ``.npy``) are split at ``usage.prompt_tokens``. Offline
    outputs saved with NumPy are ``.npz`` files, one request each: ``routed_experts`` with either
    ``prompt_routed_experts`` or ``num_prompt_tokens`` (where the prompt's rows end).

``sglang`` (``--enable-return-routed-experts`` and ``"return_routed_experts": true`` in the request)
    Saved OpenAI responses whose choices carry ``sgl_ext.routed_experts`` (or the response
    ``sglext.routed_experts``, or a ``/generate`` response's ``meta_info.routed_experts``): base64 of
    int32 ids, logical shape ``[tokens, layers, top_k]``. The ids carry no shape, so L and K come from the
    model's config (``--model-config``). The rows are the tokens that went through the model: positions
    ``[routed_experts_start_len, prompt + completion - 1)`` (the last generated token is never fed back),
    so a response with fewer rows than ``prompt + completion - 1`` was asked with that offset and its
    first rows are missing from the prompt.

``npy``
    Plain integer arrays ``[tokens, layers, top_k]``: a ``.npy`` per request, or an ``.npz`` holding one
    array per request (in stored order). Every row is a decode token of its own iteration.

Tokens become iterations as an engine runs them: a request's prompt rows form one prefill iteration and
each generated row one decode iteration. Several responses are several requests (one per choice), in the
order of their ``created`` times where every response has one, else in file order, interleaved as a
continuous-batching server runs them (:func:`schedule`). One file may hold one model's responses only.
"""

from __future__ import annotations

import heapq
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_offload.errors import ConfigError, TraceError
from moe_offload.inputs import check_input
from moe_offload.trace.format import DECODE, PREFILL, Trace
from moe_offload.trace.importers.common import _as_paths, _assemble, _check_num_experts, _check_requests_ids, _Request
from moe_offload.trace.importers.model_config import ModelShape
from moe_offload.trace.importers.responses import (ResponseError, check_id_array, decode_int32_ids,
                                                   decode_nested_or_encoded, read_responses, usage_counts)


def import_vllm(paths, *, num_experts: int | None = None, model: str | None = None, expert_bytes: int | None = None,
                hidden_size: int | None = None, source: str | None = None, license: str | None = None,
                extra: dict | None = None, model_config: ModelShape | None = None) -> Trace:
    """Import vLLM responses (``.json``/``.jsonl``) and offline outputs (``.npz``)."""
    def read(path: Path) -> list[Routed]:
        if path.suffix.lower() == ".npz":
            return [Routed(None, path, 0, *_vllm_offline(path))]
        return _each_response(path, vllm_rows)
    return _import("vllm", paths, read, num_experts, model, expert_bytes, hidden_size, source, license, extra,
                   model_config)


def import_sglang(paths, *, num_experts: int | None = None, model: str | None = None,
                  expert_bytes: int | None = None, hidden_size: int | None = None, source: str | None = None,
                  license: str | None = None, extra: dict | None = None,
                  model_config: ModelShape | None = None) -> Trace:
    """Import SGLang responses; ``model_config`` is required (the ids are flat)."""
    if model_config is None:
        raise ConfigError("sglang routing is a flat list of ids without its shape: give the model's config "
                          "(--model-config config.json) for its layers and top-k")
    def read(path: Path) -> list[Routed]:
        return _each_response(path, lambda response, where, index: sglang_rows(response, where, index,
                                                                              shape=model_config))
    return _import("sglang", paths, read, num_experts, model, expert_bytes, hidden_size, source, license, extra,
                   model_config)


def import_npy(paths, *, num_experts: int | None = None, model: str | None = None, expert_bytes: int | None = None,
               hidden_size: int | None = None, source: str | None = None, license: str | None = None,
               extra: dict | None = None, model_config: ModelShape | None = None) -> Trace:
    """Import plain ``[tokens, layers, top_k]`` arrays, every row a decode token."""
    def read(path: Path) -> list[Routed]:
        return [Routed(None, path, number, np.zeros((0,) + a.shape[1:], np.int64), a)
                for number, a in enumerate(_arrays(path))]
    return _import("npy", paths, read, num_experts, model, expert_bytes, hidden_size, source, license, extra,
                   model_config)


# ------------------------------------------------------------------------------------------------------ vLLM

def vllm_rows(response: dict, path: Path, index: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt rows, generated rows) of each choice of one vLLM response."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ResponseError(path, index, "no choices: is this an OpenAI response?")
    prompt_tokens, completion_tokens = usage_counts(response, path, index)
    prompt_field = response.get("prompt_routed_experts")
    prompt = None if prompt_field is None else decode_nested_or_encoded(prompt_field, path, index,
                                                                       "prompt_routed_experts")
    if prompt is not None and prompt_tokens is not None and len(prompt) != prompt_tokens:
        raise ResponseError(path, index, f"prompt_routed_experts has {len(prompt)} rows, but usage.prompt_tokens "
                                         f"is {prompt_tokens}")
    result = []
    for number, choice in enumerate(choices):
        field = f"choices[{number}].routed_experts"
        value = choice.get("routed_experts") if isinstance(choice, dict) else None
        if value is None:
            if prompt is None:
                raise ResponseError(path, index, "no routing: neither prompt_routed_experts nor "
                                                 f"{field} (start vLLM with --enable-return-routed-experts)")
            generated = np.zeros((0,) + prompt.shape[1:], np.int64)
        else:
            generated = decode_nested_or_encoded(value, path, index, field)
        if prompt is None:  # the whole sequence in the choice: the prompt's rows come first
            if prompt_tokens is None:
                raise ResponseError(path, index, f"{field} holds the whole sequence, but usage.prompt_tokens (where "
                                                 "the prompt ends) is missing")
            if len(generated) < prompt_tokens:
                raise ResponseError(path, index, f"{field} has {len(generated)} rows, fewer than the "
                                                 f"{prompt_tokens} prompt tokens")
            result.append((generated[:prompt_tokens], generated[prompt_tokens:]))
            continue
        if generated.size and generated.shape[1:] != prompt.shape[1:]:
            raise ResponseError(path, index, f"{field} has shape {list(generated.shape)}, but the prompt's rows "
                                             f"have {list(prompt.shape[1:])} layers x top-k")
        if len(choices) == 1 and completion_tokens is not None and len(generated) not in (completion_tokens,
                                                                                          completion_tokens - 1):
            raise ResponseError(path, index, f"{field} has {len(generated)} rows for {completion_tokens} "
                                             "generated tokens")
        result.append((prompt, generated))
    return result


def _vllm_offline(path: Path) -> tuple[np.ndarray, np.ndarray]:
    arrays = _load_npz(path)
    if "routed_experts" not in arrays:
        raise TraceError(path, f"no 'routed_experts' array (found {', '.join(sorted(arrays)) or 'none'})")
    routed = check_id_array(arrays["routed_experts"], path, 0, "routed_experts")
    if "prompt_routed_experts" in arrays:
        return check_id_array(arrays["prompt_routed_experts"], path, 0, "prompt_routed_experts"), routed
    if "num_prompt_tokens" not in arrays:
        raise TraceError(path, "the prompt/generation split is missing: save 'prompt_routed_experts' or "
                               "'num_prompt_tokens' beside 'routed_experts'")
    split = arrays["num_prompt_tokens"]
    if split.shape != () or not np.issubdtype(split.dtype, np.integer) or not 0 <= int(split) <= len(routed):
        raise TraceError(path, f"num_prompt_tokens must be one integer within 0..{len(routed)}, not {split!r}")
    return routed[:int(split)], routed[int(split):]


# ---------------------------------------------------------------------------------------------------- SGLang

def sglang_rows(response: dict, path: Path, index: int, shape: ModelShape) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt rows, generated rows) of each choice of one SGLang response (or /generate answer)."""
    prompt_tokens, completion_tokens = usage_counts(response, path, index)
    choices = response.get("choices")
    if isinstance(choices, list) and choices:
        top_level = (response.get("sglext") or {}).get("routed_experts") if len(choices) == 1 else None
        encoded = [((c.get("sgl_ext") or {}).get("routed_experts") if isinstance(c, dict) else None) or top_level
                   for c in choices]
        fields = [f"choices[{n}].sgl_ext.routed_experts" for n in range(len(choices))]
    elif isinstance(response.get("meta_info"), dict):  # the native /generate endpoint
        meta = response["meta_info"]
        encoded, fields = [meta.get("routed_experts")], ["meta_info.routed_experts"]
        prompt_tokens = meta.get("prompt_tokens", prompt_tokens)
        completion_tokens = meta.get("completion_tokens", completion_tokens)
    else:
        raise ResponseError(path, index, "no choices: is this an OpenAI response?")
    if prompt_tokens is None or completion_tokens is None:
        raise ResponseError(path, index, "usage.prompt_tokens and usage.completion_tokens are needed to split "
                                         "the prompt's rows from the generated ones")
    result = []
    for value, field in zip(encoded, fields):
        if value is None:
            raise ResponseError(path, index, f"no routing: {field} is missing (start SGLang with "
                                             "--enable-return-routed-experts and send return_routed_experts: true)")
        ids = decode_int32_ids(value, path, index, field)
        rows = _sglang_shape(ids, prompt_tokens + completion_tokens - 1, shape, path, index, field)
        offset = prompt_tokens + completion_tokens - 1 - len(rows)  # routed_experts_start_len
        prompt_rows = max(prompt_tokens - offset, 0)
        result.append((rows[:prompt_rows], rows[prompt_rows:]))
    return result


def _sglang_shape(ids: np.ndarray, expected_rows: int, shape: ModelShape, path, index: int,
                  field: str) -> np.ndarray:
    """The flat ids as [rows, MoE layers, K]. An engine that also reports its dense decoder layers (ids
    in every decoder layer) gives num_hidden_layers rows per token: only the MoE layers' are kept."""
    K, L = shape.top_k, shape.num_layers
    if shape.num_hidden_layers != L and ids.size == expected_rows * shape.num_hidden_layers * K:
        return ids.reshape(expected_rows, shape.num_hidden_layers, K)[:, list(shape.moe_layers)]
    if ids.size % (L * K):
        raise ResponseError(path, index, f"{field}: {ids.size} ids is not a whole number of tokens of {L} layers x "
                                         f"top-{K} (the model config's shape)")
    rows = ids.size // (L * K)
    if rows > expected_rows:
        raise ResponseError(path, index, f"{field}: {rows} tokens of {L} layers x top-{K}, more than the "
                                         f"{expected_rows} (prompt + completion - 1) that went through the model")
    return ids.reshape(rows, L, K)


# ----------------------------------------------------------------------------------------------------- NumPy

def _arrays(path: Path) -> list[np.ndarray]:
    if path.suffix.lower() == ".npz":
        arrays = list(_load_npz(path).items())
    else:
        check_input(path, "NumPy array", TraceError)
        try:
            arrays = [("array", np.load(path, allow_pickle=False))]
        except (ValueError, OSError, EOFError) as exc:
            raise TraceError(path, f"not a readable .npy array ({exc})") from None
    if not arrays:
        raise TraceError(path, "no arrays in the file")
    return [check_id_array(array, path, number, f"array {name!r}", unit="array")
            for number, (name, array) in enumerate(arrays)]


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    check_input(path, "NumPy archive", TraceError)
    if not zipfile.is_zipfile(path):
        raise TraceError(path, "not an .npz archive (a zip file of .npy arrays, as numpy.savez writes)")
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (ValueError, OSError, EOFError) as exc:
        raise TraceError(path, f"not a readable .npz archive ({exc})") from None


# ---------------------------------------------------------------------------------------------------- shared

@dataclass
class Routed:
    """One request's routing as an engine returned it, with where it came from (for messages) and, when
    known, when it was sent and answered (seconds on one clock)."""

    model: str | None
    path: Path | str     # the file (or the server) it came from
    index: int           # the response (or array) number there
    prompt: np.ndarray   # [prompt rows, L, K]
    generated: np.ndarray  # [generated rows, L, K]
    arrival: float | None = None
    done: float | None = None
    passes: list[int] | None = None  # the server's forward passes it ran in (moe-offload serve tells them)


def _each_response(path: Path, rows_of) -> list[Routed]:
    """A Routed for every choice of every response of a file; arrival = the response's ``created``."""
    result = []
    for index, response in enumerate(read_responses(path)):
        created = response.get("created")
        created = created if isinstance(created, (int, float)) and not isinstance(created, bool) else None
        for prompt, generated in rows_of(response, path, index):
            result.append(Routed(response.get("model"), path, index, prompt, generated, created))
    return result


def _import(format_name: str, paths, read, num_experts, model, expert_bytes, hidden_size, source, license, extra,
            model_config: ModelShape | None) -> Trace:
    paths = _as_paths(paths)
    _check_num_experts(num_experts)  # a bad option is refused before any file is read
    routed = [entry for path in paths for entry in read(path)]
    return build_trace(format_name, routed, paths, num_experts=num_experts, model=model, expert_bytes=expert_bytes,
                       hidden_size=hidden_size, source=source, license=license, extra=extra,
                       model_config=model_config)


def build_trace(format_name: str, routed: list[Routed], paths: list[Path], *, num_experts=None, model=None,
                expert_bytes=None, hidden_size=None, source=None, license=None, extra=None,
                model_config: ModelShape | None = None) -> Trace:
    """The trace of the requests ``routed``, checked, in arrival order where every one has an arrival time
    (else in list order), placed as :func:`schedule` says."""
    _check_num_experts(num_experts)
    if model_config is not None:
        num_experts = num_experts or model_config.num_experts
        expert_bytes = expert_bytes or model_config.expert_bytes
        hidden_size = hidden_size or model_config.hidden_size
    _check_one_model(routed)
    if all(entry.arrival is not None for entry in routed):
        routed = sorted(routed, key=lambda entry: entry.arrival)  # stable: list order among equal times
    unit = "array" if format_name == "npy" else "response"
    requests = [_request(entry, unit) for entry in routed]
    shape = requests[0].experts.shape[1:]
    for request in requests:
        if request.experts.shape[1:] != shape:
            raise TraceError(request.path, f"routing of {list(request.experts.shape[1:])} layers x top-k, but the "
                                           f"first request's is {list(shape)}", row=request.locator[0], unit=unit)
        if model_config is not None and shape != (model_config.num_layers, model_config.top_k):
            raise TraceError(request.path, f"routing of {shape[0]} layers x top-{shape[1]}, but the model config "
                                           f"has {model_config.num_layers} MoE layers x top-{model_config.top_k}",
                             row=request.locator[0], unit=unit)
    _check_requests_ids(requests, num_experts, paths, f"{format_name} routing does not say how many experts each "
                        "layer has; give --experts J or --model-config config.json")
    models = {entry.model for entry in routed if entry.model is not None}
    model = model or (models.pop() if models else None) or (model_config.name if model_config else "unknown")
    details = {"importer": format_name, "files": [Path(p).name for p in paths], "experts_sorted": False}
    if all(entry.arrival is not None for entry in routed):
        first = routed[0].arrival
        details["arrival_seconds"] = [round(entry.arrival - first, 6) for entry in routed]
    return _assemble(requests, paths, format_name, num_experts=num_experts, model=model, expert_bytes=expert_bytes,
                     hidden_size=hidden_size, source=source, license=license, extra={**details, **(extra or {})},
                     starts=schedule(routed, requests))


def schedule(routed: list[Routed], requests: list[_Request]) -> list[int]:
    """The iteration each request (in order) starts at. When the server said which forward passes every
    request ran in, the passes it ran (their numbers from the first); otherwise as a continuous-batching
    server admits them: one new request per forward pass, and after every request that was answered before
    it was sent (those did not share a pass with it). Without answer times, request r starts at iteration r."""
    if all(entry.passes for entry in routed):
        first = min(entry.passes[0] for entry in routed)
        return [entry.passes[0] - first for entry in routed]
    starts: list[int] = []
    answered: list[tuple[float, int]] = []  # heap of (answer time, last iteration) of the requests placed
    after = 0  # the first iteration after every request answered before the current one was sent
    for entry, request in zip(routed, requests):
        if entry.arrival is not None:  # arrivals ascend here (build_trace sorted them)
            while answered and answered[0][0] <= entry.arrival:
                after = max(after, heapq.heappop(answered)[1] + 1)
        start = max(starts[-1] + 1 if starts else 0, after)
        starts.append(start)
        if entry.done is not None:
            heapq.heappush(answered, (entry.done, start + max(request.iteration)))
    return starts


def _check_one_model(routed: list[Routed]) -> None:
    first = next((entry for entry in routed if entry.model is not None), None)
    for entry in routed:
        if entry.model is not None and entry.model != first.model:
            raise ResponseError(entry.path, entry.index, f"model {entry.model!r}, but {Path(first.path).name} "
                                                         f"response {first.index} is {first.model!r}: one trace "
                                                         "holds one model's traffic")


def _request(entry: Routed, unit: str) -> _Request:
    """A request's rows: the prompt's as one prefill iteration, then one iteration per generated row."""
    prompt, generated, path, index = entry.prompt, entry.generated, entry.path, entry.index
    if len(prompt) + len(generated) == 0:
        raise TraceError(path, "no routed tokens", row=index, unit=unit)
    if len(prompt) and len(generated) and prompt.shape[1:] != generated.shape[1:]:
        raise TraceError(path, f"prompt rows of shape {list(prompt.shape[1:])}, generated rows of "
                               f"{list(generated.shape[1:])}", row=index, unit=unit)
    experts = np.concatenate([r for r in (prompt, generated) if len(r)]).astype(np.int64)
    n_prompt, n_generated = len(prompt), len(generated)
    first_decode = 1 if n_prompt else 0
    local = list(range(first_decode + n_generated))  # the prompt's pass, then one per generated row
    if entry.passes:
        if len(entry.passes) < len(local):
            raise TraceError(path, f"{len(entry.passes)} forward passes for {len(local)} iterations of routing",
                             row=index, unit=unit)
        local = [p - entry.passes[0] for p in entry.passes[:len(local)]]
    return _Request(path=path, experts=experts, position=list(range(n_prompt + n_generated)),
                    phase=[PREFILL] * n_prompt + [DECODE] * n_generated,
                    iteration=[local[0]] * n_prompt + local[first_decode:],
                    locator=[index] * (n_prompt + n_generated), unit=unit)
