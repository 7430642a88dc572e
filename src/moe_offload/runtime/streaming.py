"""transformers' streamer protocol for the engine's generate: when each token appeared, and its text as it comes."""

from __future__ import annotations

import time


class TimingStreamer:
    """transformers' streamer protocol: records when each generated token appears, forwards text."""

    def __init__(self, tokenizer, on_text):
        self.tokenizer, self.on_text = tokenizer, on_text
        self.prompt_seen = False
        self.token_times: list[float] = []
        self._tokens: list[int] = []
        self._printed = 0

    def put(self, value) -> None:
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            return
        self.token_times.append(time.perf_counter())
        if self.on_text is not None:
            self._tokens.extend(value.reshape(-1).tolist())
            text = self.tokenizer.decode(self._tokens, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                self.on_text(text[self._printed:])
                self._printed = len(text)

    def end(self) -> None:
        if self.on_text is not None:
            text = self.tokenizer.decode(self._tokens, skip_special_tokens=True)
            if len(text) > self._printed:
                self.on_text(text[self._printed:])
                self._printed = len(text)
