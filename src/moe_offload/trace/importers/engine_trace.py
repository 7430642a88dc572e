"""From the routing engines return to a trace: which rows are expert requests, and when each request ran.

Each choice of a response is one request. Its rows cover positions ``[start, start + rows)`` of the
sequence, prompt first (``start`` > 0 when the request asked for routing from a later prompt position:
vLLM's ``routed_experts_prompt_start``, SGLang's ``routed_experts_start_len``).

**Prompt tokens that did not run the experts in this request are not expert requests.** With prefix
caching, the engine skips the first ``usage.prompt_tokens_details.cached_tokens`` prompt positions: vLLM
(which requires prefix caching for ``--enable-return-routed-experts``) stores routing per KV block keyed by
the block's hash (``vllm/distributed/aux_output_connector/routed_experts.py``), so a cached position carries
the routing of the request that computed it, and a position whose routing was not kept comes back as ``-1``
in every layer. Both are dropped by default, counted, and recorded in the trace's metadata
(``extra["prompt_tokens"]``: ``total``, ``from_prefix_cache``, ``not_returned``, ``dropped_rows``,
``kept_cached``) for ``trace info`` and ``report``; ``keep_cached_prompt`` keeps the cached positions whose
ids are present. A row with ``-1`` in some layers only is refused as corrupt (as NeMo RL refuses it); a
generated token without routing is refused too (it did run the experts; replaying without it would be
wrong).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_offload.errors import TraceError
from moe_offload.trace.format import DECODE, PREFILL, Trace
from moe_offload.trace.importers.common import _assemble, _check_num_experts, _check_requests_ids, _Request
from moe_offload.trace.importers.model_config import ModelShape
from moe_offload.trace.importers.responses import ResponseError

MISSING_ROUTE = -1


@dataclass(frozen=True)
class ChoiceRouting:
    """One choice's routing rows as the engine returned them, and what its usage said."""

    rows: np.ndarray       # [n, L, K] int64 ids of positions start .. start + n - 1; -1 = no routing kept
    start: int             # the position of the first row
    prompt_tokens: int     # positions 0 .. prompt_tokens - 1 are the prompt
    cached_tokens: int = 0  # the first cached_tokens prompt positions came from the prefix cache


@dataclass
class Routed:
    """One request's routing as an engine returned it, with where it came from (for messages) and, when
    known, when it was sent and answered (seconds on one clock)."""

    model: str | None
    path: Path | str     # the file (or the server) it came from
    index: int           # the response (or array) number there
    choice: ChoiceRouting
    arrival: float | None = None
    done: float | None = None
    passes: list[int] | None = None  # the server's forward passes it ran in (moe-offload serve tells them)


@dataclass
class PromptAccount:
    """What happened to the prompt tokens of the requests imported (``extra["prompt_tokens"]``)."""

    total: int = 0              # prompt tokens, as the responses counted them
    from_prefix_cache: int = 0  # of which the engine served from its prefix cache (cached_tokens or -1 rows)
    not_returned: int = 0       # of which the response carried no row (asked from a later start)
    dropped_rows: int = 0       # rows left out of the trace
    kept_cached: bool = False

    def as_dict(self) -> dict:
        return {"total": self.total, "from_prefix_cache": self.from_prefix_cache, "not_returned": self.not_returned,
                "dropped_rows": self.dropped_rows, "kept_cached": self.kept_cached}


def prompt_tokens_text(extra: dict) -> str | None:
    """What an engine import did with the prompt tokens that ran no experts in their request, from a trace's
    metadata (``trace info`` and ``report`` print it); None when the trace records no such account."""
    account = extra.get("prompt_tokens") if isinstance(extra, dict) else None
    if not isinstance(account, dict) or not all(isinstance(account.get(key), int) and not isinstance(
            account.get(key), bool) for key in ("total", "from_prefix_cache", "dropped_rows")):
        return None
    total, cached = account["total"], account["from_prefix_cache"]
    share = f"{cached / total:.0%} of" if total else "none of"
    kept = "kept where their ids were present" if account.get("kept_cached") is True else \
        "dropped from the trace: they ran no experts in their request"
    text = f"{share} the {total:,} prompt tokens came from the prefix cache ({cached:,}; {kept})"
    if isinstance(account.get("not_returned"), int) and account["not_returned"]:
        text += f"; {account['not_returned']:,} before the routing's start were not returned"
    return text + f"; {account['dropped_rows']:,} rows left out"


def build_trace(format_name: str, routed: list[Routed], paths: list[Path], *, num_experts=None, model=None,
                expert_bytes=None, hidden_size=None, source=None, license=None, extra=None,
                model_config: ModelShape | None = None, keep_cached_prompt: bool = False) -> Trace:
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
    account = PromptAccount(kept_cached=keep_cached_prompt)
    kept, requests = [], []
    for entry in routed:
        request = _request(entry, unit, keep_cached_prompt, account)
        if request is not None:
            kept.append(entry)
            requests.append(request)
    if not requests:
        first = routed[0]
        raise TraceError(first.path, "no routed tokens: every prompt token came from the prefix cache or has no "
                                     "routing, and no generated token was routed (--keep-cached-prompt keeps "
                                     "cached prompt rows whose ids are present)")
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
    models = {entry.model for entry in kept if entry.model is not None}
    model = model or (models.pop() if models else None) or (model_config.name if model_config else "unknown")
    details = {"importer": format_name, "files": [Path(p).name for p in paths], "experts_sorted": False}
    if account.total:
        details["prompt_tokens"] = account.as_dict()
    if all(entry.arrival is not None for entry in kept):
        first = kept[0].arrival
        details["arrival_seconds"] = [round(entry.arrival - first, 6) for entry in kept]
    return _assemble(requests, paths, format_name, num_experts=num_experts, model=model, expert_bytes=expert_bytes,
                     hidden_size=hidden_size, source=source, license=license, extra={**details, **(extra or {})},
                     starts=schedule(kept, requests))


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
            raise ResponseError(entry.path, entry.index, f"model {entry.model!r:.100}, but {Path(first.path).name} "
                                                         f"response {first.index} is {first.model!r:.100}: one "
                                                         "trace holds one model's traffic")


def _request(entry: Routed, unit: str, keep_cached: bool, account: PromptAccount) -> _Request | None:
    """A request's expert requests: its prompt rows that ran the experts as one prefill iteration, then one
    iteration per generated row; None when nothing of it ran the experts."""
    choice, path, index = entry.choice, entry.path, entry.index
    rows, start, prompt_tokens = choice.rows, choice.start, choice.prompt_tokens
    positions = start + np.arange(len(rows), dtype=np.int64)
    missing = (rows == MISSING_ROUTE).reshape(len(rows), -1)
    partial = missing.any(axis=1) & ~missing.all(axis=1)
    if partial.any():
        row = int(np.flatnonzero(partial)[0])
        raise TraceError(path, f"position {start + row}: some layers' expert ids are -1 (no route) and others are "
                               "not: a corrupt routing row", row=index, unit=unit)
    missing = missing.all(axis=1) if rows.size else np.zeros(len(rows), bool)
    prompt = positions < prompt_tokens
    if (missing & ~prompt).any():
        row = int(np.flatnonzero(missing & ~prompt)[0])
        raise TraceError(path, f"generated token at position {start + row} has no routing (-1 in every layer)",
                         row=index, unit=unit)
    cached = prompt & (positions < choice.cached_tokens)
    drop = missing | (cached & (not keep_cached))
    account.total += prompt_tokens
    account.from_prefix_cache += choice.cached_tokens + int(np.count_nonzero(missing & ~cached))
    account.not_returned += min(start, prompt_tokens)
    account.dropped_rows += int(np.count_nonzero(drop))
    keep = ~drop
    experts, positions, is_prompt = rows[keep], positions[keep], prompt[keep]
    if not len(experts):
        return None
    n_prompt, n_generated = int(is_prompt.sum()), int((~is_prompt).sum())
    first_decode = 1 if n_prompt else 0
    local = list(range(first_decode + n_generated))  # the prompt's pass, then one per generated row
    if entry.passes:
        if len(entry.passes) < len(local):
            raise TraceError(path, f"{len(entry.passes)} forward passes for {len(local)} iterations of routing",
                             row=index, unit=unit)
        local = [p - entry.passes[0] for p in entry.passes[:len(local)]]
    return _Request(path=path, experts=experts, position=positions.tolist(),
                    phase=[PREFILL] * n_prompt + [DECODE] * n_generated,
                    iteration=[local[0]] * n_prompt + local[first_decode:],
                    locator=[index] * len(experts), unit=unit)
