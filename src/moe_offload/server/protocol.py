"""The OpenAI wire format the server speaks: request bodies (checked), responses, stream chunks and errors.

Requests are pydantic models that forbid unknown fields: a parameter the server does not implement
(``logprobs``, ``n`` above 1, penalties, tools) is refused with a 400 naming it rather than ignored. Every
error is OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moe_offload.text.sources import format_conversation

# OpenAI's default for /v1/completions; chat answers until the end of the text, bounded here.
COMPLETION_MAX_TOKENS = 16
CHAT_MAX_TOKENS = 256


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = None  # accepted and unused, as a tag for the caller
    # SGLang's extension (server/routed_experts.py): the routing of the request's tokens in sgl_ext
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(0, ge=0)

    def stop_sequences(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise APIError(400, "stop: at most 4 sequences", param="stop")
        if any(not s for s in stops):
            raise APIError(400, "stop: a stop sequence must not be empty", param="stop")
        return tuple(stops)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    echo: Literal[False] = False

    def prompt_input(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list):
            if prompt and all(isinstance(p, str) for p in prompt):
                if len(prompt) != 1:
                    raise APIError(400, "prompt: one prompt per request (a list of one string)", param="prompt")
                return prompt[0]
            if not prompt:
                raise APIError(400, "prompt: empty", param="prompt")
            return [int(t) for t in prompt]
        if not prompt:
            raise APIError(400, "prompt: empty", param="prompt")
        return prompt


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


def parse(model: type[_Strict], body) -> _Strict:
    """A request body as ``model``, or an APIError naming the first problem."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            raise APIError(400, f"unknown or unsupported parameter {where!r}", param=where,
                           code="unsupported_parameter") from None
        if first["type"] == "missing":
            raise APIError(400, f"missing required parameter {where!r}", param=where, code="missing_parameter") \
                from None
        raise APIError(400, f"{where}: {first['msg']}", param=where, code="invalid_value") from None


def chat_text(tokenizer, messages: list[ChatMessage]) -> str:
    """The prompt of a conversation: the tokenizer's chat template when it has one, otherwise the bundled
    model's format (``User: ...`` lines, text/sources.py), ending where the assistant's answer begins."""
    turns = [{"role": m.role, "content": m.content} for m in messages]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    text = format_conversation([{"from": m.role, "value": m.content} for m in messages])
    return f"{text}\nAssistant:" if text else "Assistant:"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def request_counters(stats) -> dict:
    """The request's own expert-cache counters (the extension field ``moe_offload`` of a response)."""
    return {"expert_requests": stats.accesses, "expert_hits": stats.hits, "hit_rate": stats.hit_rate,
            "on_demand_loads": stats.on_demand_loads, "prefetches_used": stats.prefetches_used,
            "stall_seconds": stats.stall_seconds, "ttft_seconds": stats.ttft_seconds,
            "tpot_seconds": stats.tpot_seconds}


def completion_body(kind: str, rid: str, model: str, completion) -> dict:
    """The non-streaming response of /v1/completions (``kind`` "text") or /v1/chat/completions ("chat")."""
    if kind == "text":
        choice = {"index": 0, "text": completion.text, "logprobs": None, "finish_reason": completion.finish_reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": completion.text},
                  "logprobs": None, "finish_reason": completion.finish_reason}
        obj = "chat.completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(completion.prompt_tokens, len(completion.token_ids)),
            "moe_offload": request_counters(completion.stats)}


def chunk_body(kind: str, rid: str, model: str, text: str | None, finish_reason: str | None = None,
               first: bool = False) -> dict:
    """One server-sent event of a stream."""
    if kind == "text":
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta = {}
        if first:
            delta["role"] = "assistant"
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
