"""One request inside the continuous-batching scheduler (runtime/batching.py): its state (``RunningRequest``:
tokens, times, text sent, KV slot) and its own step after each pass, which touches nothing of another request:
sample its next token with its own generator (runtime/sampling.py), detokenise, apply the stop rules (end of
sequence, a stop string, ``max_tokens``) and stream the text that no later token can change."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_offload.runtime.counters import Counters
from moe_offload.runtime.requests import RequestHandle, SamplingParams, TextDelta
from moe_offload.runtime.sampling import sample, token_logprobs


@dataclass
class RunningRequest:
    """A request's state inside the scheduler (runtime/batching.py)."""

    id: int
    prompt: list[int]
    params: SamplingParams
    handle: RequestHandle
    generator: object
    counters: Counters
    arrived: float
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    logits: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    joined: float | None = None  # when it joined the batch
    sent: int = 0   # characters of text already emitted
    text: str = ""
    slot: int | None = None  # its rows in the KV pool, while it runs
    passes: list[int] = field(default_factory=list)  # numbers of the scheduler's passes it ran in

    @property
    def prefilled(self) -> bool:
        return bool(self.tokens)

    def step(self, logits, now: float, eos: set[int], tokenizer) -> str | None:
        """This request's step after a pass: sample its next token from its ``logits``, detokenise, apply the
        stop rules and stream the text that is stable; the finish reason ("stop", "length"), or None while it
        goes on. ``eos``: the model's end-of-sequence ids; ``tokenizer``: None to stream tokens only."""
        params = self.params
        token = sample(logits, params, self.generator, self.tokens, self.prompt)
        self.tokens.append(token)
        self.token_times.append(now)
        if params.return_logits:
            self.logits.append(logits.cpu())
        new_logprobs = None
        if params.logprobs is not None:
            new_logprobs = [token_logprobs(logits, token, params.logprobs)]
            self.logprobs.extend(new_logprobs)
        finish = None
        if token in eos and not params.ignore_eos:
            finish = "stop"
        if tokenizer is not None:
            decoded = tokenizer.decode(self.tokens, skip_special_tokens=True)
            cut = min((i for i in (decoded.find(s) for s in params.stop) if i >= 0), default=-1)
            if cut >= 0:
                decoded, finish = decoded[:cut], "stop"
            self.text = decoded
        if finish is None and len(self.tokens) >= params.max_tokens:
            finish = "length"
        if finish is None:
            stable = stable_prefix(self.text, params.stop)
            if len(stable) > self.sent:
                self.handle._emit(TextDelta(stable[self.sent:], [token], new_logprobs))
                self.sent = len(stable)
            else:
                self.handle._emit(TextDelta("", [token], new_logprobs))
            return None
        if len(self.text) > self.sent or new_logprobs:
            self.handle._emit(TextDelta(self.text[self.sent:], [token], new_logprobs))
            self.sent = len(self.text)
        return finish


def stable_prefix(text: str, stop: tuple[str, ...]) -> str:
    """The text that can be sent now: not a trailing incomplete character, nor a trailing piece that may
    become a stop sequence."""
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return text[:len(text) - hold]
