"""The OpenAI answers the server writes: responses, stream chunks, usage and log-probabilities.

A request's choices are numbered as OpenAI numbers them: with several prompts (completions) and ``n``
choices each, choice ``index = prompt * n + j``. Log-probabilities are in each endpoint's own form:
chat ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}``, completions
``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`` (the chosen token is
always among ``top_logprobs``, so a dict holds up to ``logprobs + 1`` entries, as OpenAI documents).
"""

from __future__ import annotations

import time


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def request_counters(stats) -> dict:
    """The request's own expert-cache counters (the extension field ``moe_offload`` of a response)."""
    return {"expert_requests": stats.accesses, "expert_hits": stats.hits, "hit_rate": stats.hit_rate,
            "on_demand_loads": stats.on_demand_loads, "prefetches_used": stats.prefetches_used,
            "stall_seconds": stats.stall_seconds, "ttft_seconds": stats.ttft_seconds,
            "tpot_seconds": stats.tpot_seconds}


def summed_counters(completions: list) -> dict:
    """The counters of a request of several choices: each choice's summed; its hit rate and times those of
    the first choice when there is one only."""
    if len(completions) == 1:
        return request_counters(completions[0].stats)
    each = [request_counters(c.stats) for c in completions]
    total = {key: sum(c[key] or 0 for c in each) for key in ("expert_requests", "expert_hits", "on_demand_loads",
                                                        "prefetches_used", "stall_seconds")}
    total["hit_rate"] = total["expert_hits"] / total["expert_requests"] if total["expert_requests"] else 0.0
    return total


class LogprobWriter:
    """Log-probabilities (the scheduler's ``(logprob, [(id, logprob)])`` per token) in an endpoint's form."""

    def __init__(self, kind: str, tokenizer):
        self.kind, self.tokenizer = kind, tokenizer

    def token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def body(self, token_ids: list[int], entries: list, offset: int = 0) -> dict:
        """The ``logprobs`` of a choice (or of a chunk: ``offset`` is the text already sent before it)."""
        if self.kind == "chat":
            return {"content": [self._chat_entry(t, lp, best) for t, (lp, best) in zip(token_ids, entries)],
                    "refusal": None}
        tokens = [self.token(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        top = []
        for t, (lp, best) in zip(token_ids, entries):
            alternatives = {self.token(i): v for i, v in best}
            alternatives.setdefault(self.token(t), lp)
            top.append(alternatives)
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in entries], "top_logprobs": top,
                "text_offset": offsets}

    def _chat_entry(self, token_id: int, logprob: float, best: list) -> dict:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")),
                "top_logprobs": [{"token": (alt := self.token(i)), "logprob": v, "bytes": list(alt.encode("utf-8"))}
                                 for i, v in best]}


def completion_body(kind: str, rid: str, model: str, completions: list, n: int,
                    logprobs: LogprobWriter | None) -> dict:
    """The non-streaming response of /v1/completions (``kind`` "text") or /v1/chat/completions ("chat"),
    one choice per Completion, in index order (``n`` choices per prompt)."""
    choices = []
    for index, completion in enumerate(completions):
        lp = None if logprobs is None else logprobs.body(completion.token_ids, completion.logprobs)
        if kind == "text":
            choices.append({"index": index, "text": completion.text, "logprobs": lp,
                            "finish_reason": completion.finish_reason})
        else:
            choices.append({"index": index, "message": {"role": "assistant", "content": completion.text},
                            "logprobs": lp, "finish_reason": completion.finish_reason})
    return {"id": rid, "object": "text_completion" if kind == "text" else "chat.completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(sum_prompt_tokens(completions, n), sum(len(c.token_ids) for c in completions)),
            "moe_offload": summed_counters(completions)}


def sum_prompt_tokens(completions: list, n: int) -> int:
    """The prompt tokens of a request: each prompt once, though ``n`` choices read it (OpenAI's usage)."""
    return sum(c.prompt_tokens for c in completions[::n])


def chunk_body(kind: str, rid: str, model: str, index: int, text: str | None, finish_reason: str | None = None,
               first: bool = False, logprobs: dict | None = None) -> dict:
    """One server-sent event of a stream, for choice ``index``."""
    if kind == "text":
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta = {}
        if first:
            delta["role"] = "assistant"
        if text:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
