"""The OpenAI requests the server reads: every documented parameter of /v1/chat/completions and
/v1/completions, checked, and the extra sampling parameters vLLM's and SGLang's OpenAI servers take; the
errors it answers (server/responses.py writes the answers).

Every documented parameter is accepted, because SDKs and proxies send their defaults
(``presence_penalty: 0``, ``logprobs: false``, ``tools: []``, ``response_format: {"type": "text"}``, ...).
A parameter is then one of three kinds:

- implemented: ``max_tokens``/``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``,
  ``n``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``logprobs``/``top_logprobs``,
  ``stream``/``stream_options``, a completions ``prompt`` given as a list (one choice set per prompt);
- implemented, beyond OpenAI's: ``top_k``, ``min_p`` and ``repetition_penalty``, the extra sampling
  parameters that vLLM (``vllm/entrypoints/openai/protocol.py``) and SGLang (``sglang/srt/entrypoints/openai/
  protocol.py``) accept in the same body, with vLLM's ranges and definitions (runtime/sampling.py), so a
  client written for those servers runs unchanged;
- a tag with no effect on the answer: ``user``, ``metadata``, ``prompt_cache_key``, ``safety_identifier``,
  ``parallel_tool_calls``, ``prediction`` (a latency hint: the answer is the same without it);
- honoured only at its neutral value (:data:`NEUTRAL`): a value the server cannot honour (``tools`` that
  are not empty, ``response_format`` json, ``store: true``, audio, ``echo: true``, ...) is a 400 naming the
  parameter, never silently ignored.

A name that is not a documented parameter is a 400 naming it too. Non-finite numbers never get here: the
body parser refuses NaN and Infinity (inputs.parse_json).
"""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moe_offload.text.sources import format_conversation

# OpenAI's default for /v1/completions; chat answers until the end of the text, bounded here.
COMPLETION_MAX_TOKENS = 16
CHAT_MAX_TOKENS = 256
MAX_CHOICES = 128  # n x prompts in one request, OpenAI's bound on n


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # padding against length side channels: none is sent here


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(1.0, ge=0, le=2)
    top_p: float | None = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    top_k: int | None = Field(None, ge=-1)  # vLLM's and SGLang's extras: 0 or -1 keep every token
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    user: str | None = None  # tags for the caller: accepted, no effect on the answer
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
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

    def token_bias(self) -> dict[int, float]:
        """``logit_bias`` with its keys (token ids written as strings, OpenAI's form) as numbers."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) < 12):
                raise APIError(400, f"logit_bias: the key {key[:40]!r} is not a token id", param="logit_bias",
                               code="invalid_value")
            if not -100 <= value <= 100:
                raise APIError(400, f"logit_bias: the bias {value} of token {key} is outside -100..100",
                               param="logit_bias", code="invalid_value")
            bias[int(key)] = value
        return bias


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each answered with ``n`` choices (OpenAI: a list of strings or of token lists is a
        batch; a list of numbers is one prompt of token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise APIError(400, "prompt: empty", param="prompt", code="invalid_value")
        return prompts

    def logprob_count(self) -> int | None:
        """None (no log-probabilities), or how many of the most likely tokens to report with each."""
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list | None = None
    function_call: dict | None = None
    audio: dict | None = None

    def text(self, index: int) -> str:
        """The message's text: a string, or its text parts joined by newlines (as vLLM joins them)."""
        where = f"messages.{index}"
        if self.tool_calls or self.function_call is not None or self.audio is not None:
            field = "tool_calls" if self.tool_calls else "function_call" if self.function_call is not None \
                else "audio"
            raise APIError(400, f"{where}.{field}: this server has no tools or audio", param=f"{where}.{field}",
                           code="unsupported_value")
        if self.content is None:
            raise APIError(400, f"{where}.content: missing", param=f"{where}.content", code="missing_parameter")
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            kind = part.get("type")
            if kind != "text":
                raise APIError(400, f"{where}.content.{j}: a {kind!r} part; this model reads text parts only",
                               param=f"{where}.content.{j}.type", code="unsupported_value")
            try:
                texts.append(TextPart.model_validate(part).text)
            except ValidationError as exc:
                raise _validation_error(exc, f"{where}.content.{j}") from None
        return "\n".join(texts)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None
    audio: dict | None = None
    modalities: list[str] | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def logprob_count(self) -> int | None:
        """None (no log-probabilities), or how many of the most likely tokens to report with each."""
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs",
                               code="invalid_value")
            return None
        return self.top_logprobs or 0


# parameter -> (is this value a no-op here, why another value cannot be honoured)
NEUTRAL = {
    "store": (lambda v: not v, "this server does not store completions"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "this server has one service tier"),
    "tools": (lambda v: not v, "this server does not call tools"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "this server does not call tools"),
    "functions": (lambda v: not v, "this server does not call functions"),
    "function_call": (lambda v: v in (None, "none", "auto"), "this server does not call functions"),
    "response_format": (lambda v: v is None or v == {"type": "text"}, "only text responses"),
    "audio": (lambda v: v is None, "this model answers in text only"),
    "modalities": (lambda v: v is None or v == ["text"], "this model answers in text only"),
    "reasoning_effort": (lambda v: v is None, "this model does not reason before answering"),
    "verbosity": (lambda v: v in (None, "medium"), "this server has one verbosity"),
    "web_search_options": (lambda v: v is None, "this server does not search the web"),
    "echo": (lambda v: not v, "the prompt is not echoed back"),
    "suffix": (lambda v: not v, "this model does not insert text before a suffix"),
}


def refuse_unhonoured(request: _Sampling) -> None:
    """A 400 naming the first parameter whose value the server cannot honour."""
    for name, (neutral, why) in NEUTRAL.items():
        if name in type(request).model_fields and not neutral(getattr(request, name)):
            raise APIError(400, f"{name}: {getattr(request, name)!r} cannot be honoured: {why}", param=name,
                           code="unsupported_value")
    best_of = getattr(request, "best_of", None)
    if best_of is not None and best_of != (request.n or 1):
        raise APIError(400, "best_of: only best_of equal to n (no candidates are generated and dropped)",
                       param="best_of", code="unsupported_value")


def parse(model: type[_Strict], body) -> _Strict:
    """A request body as ``model``, or an APIError naming the first problem."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    refuse_unhonoured(request)
    return request


def _validation_error(exc: ValidationError, prefix: str = "") -> APIError:
    first = exc.errors()[0]
    where = ".".join(part for part in [prefix, *(str(p) for p in first["loc"])] if part) or None
    if first["type"] == "extra_forbidden":
        return APIError(400, f"unknown parameter {where!r} (not an OpenAI parameter)", param=where,
                        code="unsupported_parameter")
    if first["type"] == "missing":
        return APIError(400, f"missing required parameter {where!r}", param=where, code="missing_parameter")
    return APIError(400, f"{where}: {first['msg']}", param=where, code="invalid_value")


def chat_text(tokenizer, messages: list[ChatMessage]) -> str:
    """The prompt of a conversation: the tokenizer's chat template when it has one, otherwise the bundled
    model's format (``User: ...`` lines, text/sources.py), ending where the assistant's answer begins.
    A ``developer`` message is OpenAI's newer name for a system message."""
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
             for i, m in enumerate(messages)]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    text = format_conversation([{"from": t["role"], "value": t["content"]} for t in turns])
    return f"{text}\nAssistant:" if text else "Assistant:"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
