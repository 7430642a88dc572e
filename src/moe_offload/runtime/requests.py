"""A request's records, as its callers see them: how it generates (SamplingParams), the text it streams
(TextDelta), its end (Completion) and the handle to follow or cancel it (RequestHandle).

The continuous-batching scheduler (runtime/batching.py) makes and fills them; the engine's ``submit`` and
``generate_batch`` and the server (server/app.py) hand them to their callers. Kept apart from the scheduler
so that a caller needs only these records, not the loop that runs the requests.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from moe_offload.results import RunResult
from moe_offload.values import integer, number, text

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass
class SamplingParams:
    """How one request generates (runtime/sampling.py). ``temperature`` 0 is greedy; otherwise softmax
    sampling at that temperature over the smallest set of tokens whose probability reaches ``top_p``, drawn
    with the request's own generator seeded with ``seed`` (the same tokens whatever else runs in the batch).
    ``logit_bias`` (token id -> added to its logit) and the presence and frequency penalties are OpenAI's;
    ``top_k`` (0 or -1: all tokens), ``min_p`` (0: off) and ``repetition_penalty`` (1: off) are the extra
    sampling parameters of vLLM's and SGLang's OpenAI servers, with vLLM's definitions (runtime/sampling.py).
    ``stop``: strings that end the generation, left out of the text (OpenAI's rule). ``logprobs``: None, or
    how many of the most likely tokens to report with each token's log-probability."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    return_logits: bool = False
    return_routed_experts: bool = False  # the Completion carries the routing of the tokens fed (routing_log.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def check(self) -> None:
        """Each field checked (values.py), in place; a ConfigError names the first bad one."""
        self.max_tokens = integer(self.max_tokens, "max_tokens", low=1)
        self.temperature = number(self.temperature, "temperature", low=0, high=2)  # OpenAI's range
        self.top_p = number(self.top_p, "top_p", low=0, high=1, low_open=True)
        self.presence_penalty = number(self.presence_penalty, "presence_penalty", low=-2, high=2)
        self.frequency_penalty = number(self.frequency_penalty, "frequency_penalty", low=-2, high=2)
        self.top_k = integer(self.top_k, "top_k", low=-1, why="0 or -1: every token")  # vLLM's range
        self.min_p = number(self.min_p, "min_p", low=0, high=1)
        self.repetition_penalty = number(self.repetition_penalty, "repetition_penalty", low=0, low_open=True)
        self.logit_bias = {integer(token, "a logit_bias token id", low=0): number(bias, "a logit_bias value",
                                                                                  low=-100, high=100)
                           for token, bias in self.logit_bias.items()}
        if self.logprobs is not None:
            self.logprobs = integer(self.logprobs, "logprobs", low=0, high=20)
        if self.seed is not None:
            self.seed = integer(self.seed, "seed", low=0, high=2**63 - 1)
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(text(s, "a stop sequence") for s in self.stop)


@dataclass
class TextDelta:
    """New text of a running request (empty while a multi-byte character or a possible stop sequence is
    held back) and the tokens that produced it."""

    text: str
    token_ids: list[int]
    logprobs: list | None = None  # per token: (logprob, [(id, logprob) of the most likely]) (SamplingParams.logprobs)


@dataclass
class Completion:
    """A request's end: its text, tokens and what it cost (its own counters, as a RunResult)."""

    request: int
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    stats: RunResult | None  # None only for a request the scheduler failed to account for as it died
    error: BaseException | None = None
    logits: list | None = None  # per generated token, [vocab] (SamplingParams.return_logits)
    routed_experts: object = None  # [prompt + generated - 1, L, K] int32 (SamplingParams.return_routed_experts)
    passes: list[int] | None = None  # the scheduler's forward passes it ran in (first: its prompt), with routed_experts
    logprobs: list | None = None  # per generated token, as TextDelta.logprobs (SamplingParams.logprobs)
    queue_seconds: float | None = None  # from arrival to joining the batch (None: it never joined)


class RequestHandle:
    """A submitted request: iterate over its TextDeltas (ends after the last), or wait for its Completion.
    ``on_event`` (called from the scheduler thread) replaces the queue, for event loops."""

    def __init__(self, request: int, lock, on_event=None):
        self.request = request
        self._events: queue.Queue = queue.Queue()
        self._on_event = on_event
        self._lock = lock  # the scheduler's: it reads ``cancelled`` once per iteration under it
        self.cancelled = False
        self.completion: Completion | None = None
        self._done = threading.Event()

    def cancel(self) -> None:
        """Leave the batch at the next iteration (a client that went away). Under the scheduler's lock, so that
        an iteration sees a request either cancelled or not, never both (which would lose it and its KV slot)."""
        with self._lock:
            self.cancelled = True

    def _emit(self, event) -> None:
        if isinstance(event, Completion):
            self.completion = event
            self._done.set()
        if self._on_event is not None:
            self._on_event(event)
        else:
            self._events.put(event)

    def __iter__(self):
        while True:
            event = self._events.get()
            if isinstance(event, Completion):
                return
            yield event

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request} is still running")
        return self.completion
