"""The per-layer statistics MoEpic's cache configurator reads (paper 004, section 3.4.2, Algorithm 1 state).

After q tokens, for every layer i (section 3.4.2 of the paper):

* H_i(C), the cache hit rate: the number of times the activated experts hit the cache of layer i when it
  holds C experts, divided by the q * K activated experts;
* P_i(y), the expert prediction accuracy: how often the expert with the y-th highest predicted score is
  activated, divided by q;
* PH_i(y, C), the prediction cache hit rate: how often the expert with the y-th highest predicted score
  hits the cache of C experts, divided by q.

How they are measured here:

* The cache is what MoEpic runs between reconfigurations: C experts per layer managed by LCP, "once the
  cache miss, MoEpic evicts the lowest-priority expert and replaces it with the newly loaded expert"
  (line 116). Each C in 1..N is replayed with the project's own LCP policy on a PartitionedCache of C
  experts per layer, starting empty, so the timed simulator that later runs the configured cache sees
  these very hit rates.
* "Hits the cache" is judged when layer i is routed, on the cache as token t finds it (before its own
  requests change it): an activated expert found there is one of the alpha_i + beta_i experts of eq (5).
  The prefetch for layer i (eq 9) runs earlier, during layer i-1, but only layer i's own requests change
  layer i's cache, so PH_i sees the same cache state.
* PH_i(y, C) counts the y-th predicted expert being resident whether or not it is then activated: eq (9)
  charges (1 - PH * theta) of a full load to prefetch it, i.e. only the bottom segment when the top is
  cached, which depends on residency alone.
* The prediction of layer i is the trace's ``gate_prediction`` entry i-1 (layer i's router applied to
  layer i-1's hidden state, eq 3), ranked by descending score, ties by expert id. The paper predicts the
  first layer from the previous token's last layer (line 100): the ``next_token_gate_prediction`` of the
  request's previous token, when that token ran in an earlier pass (a decode token; the tokens of one
  prefill pass have none). P_0 and PH_0 are therefore counted over the q_0 tokens that have one, divided by
  q_0; a trace without the column has no prediction of layer 0 (P_0 = PH_0 = 0, configured without
  prefetching).

A row of the trace is a token, in trace order (as in the replay simulator). The statistics are kept online,
token by token (``OnlineStatistics``, Algorithm 1 lines 6-7): one shadow LCP cache of every size C = 1..N
per layer sees every token, so that H_i(C) is known for the sizes the run does not use; ``statistics()``
reads them after any number of tokens (every tau tokens in the timed simulator's online loop), and
``measure_statistics`` feeds a whole trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Callable

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.policies.base import AccessContext, ModelSpec
from moe_offload.policies.lcp import LCP
from moe_offload.simulator.cache import PartitionedCache
from moe_offload.trace.format import Trace


@dataclass(frozen=True)
class MoepicStatistics:
    """H, P and PH of every layer, measured on ``num_tokens`` tokens (q).

    hit_rate             [L, N+1]     H_i(C), indexed by the cache size C itself (column 0, an empty cache, is 0)
    prediction_accuracy  [L, N]       P_i(y), column y-1 for the y-th highest predicted score
    prediction_hit_rate  [L, N, N+1]  PH_i(y, C), [i, y-1, C]
    predicted            [L] bool     whether layer i has a prediction (layer 0 only from the previous token)
    """

    num_tokens: int
    top_k: int
    hit_rate: np.ndarray
    prediction_accuracy: np.ndarray
    prediction_hit_rate: np.ndarray
    predicted: np.ndarray

    @property
    def num_layers(self) -> int:
        return int(self.hit_rate.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.prediction_accuracy.shape[1])


def require_gate_prediction(trace: Trace) -> None:
    """Raise ConfigError unless ``trace`` records the speculative prediction the statistics need."""
    if trace.gate_prediction is None:
        raise ConfigError(f"{trace.path}: the trace has no gate_prediction column, and MoEpic's configurator "
                          "needs it to measure the speculative prefetcher's accuracy (paper 004, section 3.4.2); "
                          "record the trace with the next-layer gate prediction")


class OnlineStatistics:
    """Algorithm 1's state: the counts behind H, P and PH, updated by every token ``observe`` is given.

    Tokens come a pass at a time, in order; ``iteration`` numbers the passes, so that a token's layer 0 is
    predicted by its request's previous token only when that one ran in an earlier pass."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, *, omega: float = 128.0, rho: float = 0.25):
        L, J = num_layers, num_experts
        self.L, self.J, self.K = L, J, top_k
        spec = ModelSpec(L, J, top_k)
        LCP(spec, omega=omega, rho=rho)  # LCP's own checks of omega and rho, before any work
        self.caches = [PartitionedCache(size * L, L, lambda: LCP(spec, omega=omega, rho=rho), J)
                       for size in range(1, J + 1)]
        self.tokens = 0
        self.clock = 0
        self.ctx = AccessContext()
        self.hits = np.zeros((L, J + 1))                 # [i, C]: activated experts found in the cache of size C
        self.predicted_tokens = np.zeros(L)              # q_i: tokens with a prediction of layer i
        self.activated_rank = np.zeros((L, J))           # [i, y-1]: the y-th predicted expert was activated
        self.resident_rank = np.zeros((L, J, J + 1))     # [i, y-1, C]: ... was in the cache of size C
        self._last: dict[int, tuple[int, int, np.ndarray | None]] = {}  # request -> (position, pass, prediction)

    def observe(self, trace: Trace, rows, iteration: int) -> None:
        """The tokens ``rows`` of ``trace`` ran in pass ``iteration``, in this order."""
        rows = np.asarray(rows)
        L, J = self.L, self.J
        experts = trace.experts[rows].astype(np.intp)
        requests, positions = trace.request[rows].tolist(), trace.position[rows].tolist()
        order = np.full((len(rows), L, J), -1, dtype=np.intp)  # -1: no prediction of that layer
        if trace.gate_prediction is not None:
            order[:, 1:] = predicted_order(trace.gate_prediction[rows])
        following = trace.next_token_gate_prediction
        for n, (request, position) in enumerate(zip(requests, positions)):
            last = self._last.get(request)
            if last is not None and last[2] is not None and last[0] == position - 1 and last[1] < iteration:
                order[n, 0] = predicted_order(last[2][None, None])[0, 0]
        for n, (request, position) in enumerate(zip(requests, positions)):
            if request not in self._last or self._last[request][0] < position:
                prediction = None if following is None else following[rows[n]]
                self._last[request] = (position, iteration, prediction)
        for n in range(len(rows)):
            self._observe_token(experts[n], order[n], iteration, requests[n])

    def _observe_token(self, experts: np.ndarray, order: np.ndarray, iteration: int, request: int) -> None:
        L, J = self.L, self.J
        activated = np.zeros((L, J), dtype=bool)
        np.put_along_axis(activated, experts, True, axis=1)
        has = order[:, 0] >= 0
        self.predicted_tokens += has
        if has.any():
            self.activated_rank[has] += np.take_along_axis(activated[has], order[has], axis=1)
        keys = (experts + (np.arange(L) * J)[:, None]).reshape(-1).tolist()
        ctx = self.ctx
        ctx.token, ctx.iteration, ctx.request = self.tokens, iteration, request
        resident = np.zeros((L * J,), dtype=bool)
        for size, cache in enumerate(self.caches, start=1):
            resident[:] = False
            resident[list(chain.from_iterable(part.resident for part in cache.parts))] = True
            found = resident.reshape(L, J)
            self.hits[:, size] += (found & activated).sum(axis=1)
            if has.any():
                self.resident_rank[has, :, size] += np.take_along_axis(found[has], order[has], axis=1)
            clock = self.clock
            for key in keys:
                ctx.clock, ctx.layer = clock, key // J
                cache.request(key, ctx)
                clock += 1
        self.clock += len(keys)
        self.tokens += 1

    def log_priorities(self) -> np.ndarray:
        """[L, J] the log of every expert's cache priority P_ij = mu_ij rho^(nu_ij / omega) now (paper 004,
        equation 4: mu its activations so far, nu the tokens since its last), as the shadow LCP caches count
        them (each sees every token); -inf for an expert never activated."""
        J = self.J
        now = self.tokens - 1  # the last token observed: an expert it activated has nu = 0
        return np.array([[part.policy.log_priority(layer * J + expert, now) for expert in range(J)]
                         for layer, part in enumerate(self.caches[0].parts)])

    def statistics(self) -> MoepicStatistics:
        """H, P and PH of the tokens observed so far."""
        q = max(self.tokens, 1)
        per_layer = np.maximum(self.predicted_tokens, 1)
        return MoepicStatistics(num_tokens=self.tokens, top_k=self.K, hit_rate=self.hits / (q * self.K),
                                prediction_accuracy=self.activated_rank / per_layer[:, None],
                                prediction_hit_rate=self.resident_rank / per_layer[:, None, None],
                                predicted=self.predicted_tokens > 0)


def predicted_order(gate_prediction: np.ndarray) -> np.ndarray:
    """[..., layers, J] expert ids of each prediction from the highest score down (ties: lower id first)."""
    return np.argsort(-gate_prediction.astype(np.float32), axis=-1, kind="stable")


def measure_statistics(trace: Trace, *, omega: float = 128.0, rho: float = 0.25,
                       progress: Callable[[int], None] | None = None) -> MoepicStatistics:
    """H, P and PH of ``trace`` with LCP caches (parameters ``omega``, ``rho``, paper defaults), its passes in
    trace order; ``progress(tokens)`` is called after each pass."""
    require_gate_prediction(trace)
    meta = trace.meta
    online = OnlineStatistics(meta.num_layers, meta.num_experts, meta.top_k, omega=omega, rho=rho)
    cuts = np.flatnonzero(np.diff(trace.iteration)) + 1
    for rows in np.split(np.arange(trace.num_tokens), cuts):
        online.observe(trace, rows, int(trace.iteration[rows[0]]))
        if progress is not None:
            progress(len(rows))
    return online.statistics()
