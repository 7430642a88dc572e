"""MoEpic's LCP, Least Cache Priority (paper 004, equation 4).

Each expert has an activation frequency mu (accumulated activation count) and an activation interval nu
(tokens since it was last activated). Its priority is P = mu * rho ** (nu / omega); on a miss the expert
with the lowest P is evicted. Defaults omega = 128, rho = 0.25 (paper 004, section 4).

Why a heap works although nu grows for everyone: with nu = token_now - token_last,
    log P = log mu + (token_now - token_last) * log(rho) / omega,
and the token_now term is the same for all experts, so the order is that of
    log mu - token_last * log(rho) / omega,
which only changes when the expert itself is activated.
"""

from __future__ import annotations

import math

import numpy as np

from moe_offload.policies._ranked import RankedKeys, heap_new, heap_push, heap_replace_first, heap_update
from moe_offload.policies.base import EvictionPolicy
from moe_offload.values import number


class LCP(EvictionPolicy):
    name = "lcp"
    summary = "MoEpic's least cache priority: evict the lowest mu * rho^(nu/omega)"
    source = "paper 004, equation 4"
    replay_cost = 3  # LRU replays a kernel run costs (base.py)

    def __init__(self, spec, seed=0, omega: float = 128.0, rho: float = 0.25):
        super().__init__(spec, seed)
        omega = number(omega, "lcp.omega", low=0, low_open=True)
        rho = number(rho, "lcp.rho", low=0, high=1, low_open=True, high_open=True)
        self.omega, self.rho = omega, rho
        self._decay = -math.log(rho) / omega  # > 0
        self._mu: dict = {}          # key -> activations so far (kept across evictions)
        self._last_token: dict = {}  # key -> token of its last activation
        self._ranked = RankedKeys()

    def priority(self, key, token_now: int) -> float:
        """P = mu * rho ** (nu / omega) as equation 4 writes it (for reports and tests)."""
        mu = self._mu.get(key, 0)
        if mu == 0:
            return 0.0
        return mu * self.rho ** ((token_now - self._last_token[key]) / self.omega)

    def log_priority(self, key, token_now: int) -> float:
        """log P (-inf for an expert never activated): P's order, without P's underflow to 0 once an expert has
        gone unseen for some 65,000 tokens (rho^(nu/omega) < 1e-308 at the defaults)."""
        mu = self._mu.get(key, 0)
        return -math.inf if mu == 0 else math.log(mu) - (token_now - self._last_token[key]) * self._decay

    def _score(self, key):
        mu = self._mu.get(key, 0)
        return -math.inf if mu == 0 else math.log(mu) + self._last_token[key] * self._decay

    def on_access(self, key, ctx):
        if self._last_token.get(key) != ctx.token:  # several requests of one token are one activation
            self._mu[key] = self._mu.get(key, 0) + 1
            self._last_token[key] = ctx.token
        if key in self._ranked:
            self._ranked.set(key, self._score(key))

    def on_insert(self, key, ctx):
        self._ranked.set(key, self._score(key))

    def on_evict(self, key):
        self._ranked.discard(key)

    def victim(self, ctx):
        return self._ranked.victim(ctx.pinned)

    def kernel_arguments(self):
        return np.array([self._decay], np.float64), np.zeros(0, np.int64)

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them: the same score, computed with the same floating
        point operations (log of the count, plus last token times the decay in ``floats[0]``), in a heap
        ordered by (score, last set). A replayed expert is always requested before it is inserted, so its
        count is at least 1."""
        decay = floats[0]
        num_keys = num_layers * num_experts
        order, scores, stamps, position = heap_new(capacity, num_keys)
        mu = np.zeros(num_keys, np.int64)
        last_token = np.full(num_keys, -1, np.int64)
        resident = np.zeros(num_keys, np.bool_)
        size = 0
        for t in range(keys.shape[0]):
            key = keys[t]
            if last_token[key] != tokens[t]:
                mu[key] += 1
                last_token[key] = tokens[t]
            score = math.log(mu[key]) + last_token[key] * decay
            if resident[key]:
                key_hits[key] += 1
                heap_update(order, scores, stamps, position, size, key, score, t)
                continue
            resident[key] = True
            if size == capacity:  # the victim leaves and the request enters in one sift
                resident[heap_replace_first(order, scores, stamps, position, size, key, score, t)] = False
            else:
                heap_push(order, scores, stamps, position, size, key, score, t)
                size += 1
