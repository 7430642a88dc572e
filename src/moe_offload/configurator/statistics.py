"""The per-layer statistics MoEpic's cache configurator reads (paper 004, section 3.4.2, Algorithm 1 state).

After q tokens, for every layer i (lines 160-170 of the paper's text, ../shared/seeds/004_f24bbadb95ea7f91.txt):

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
  first layer from the previous token's last layer (line 100); traces do not record that, so layer 0 has
  no prediction: P_0 = PH_0 = 0 and it is configured without prefetching.

A row of the trace is a token, in trace order (as in the replay simulator).
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
    predicted            [L] bool     whether layer i has a prediction (layer 0 never has: see module doc)
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


def predicted_order(gate_prediction: np.ndarray) -> np.ndarray:
    """[n, L-1, J] expert ids of each prediction from the highest score down (ties: lower id first)."""
    return np.argsort(-gate_prediction.astype(np.float32), axis=2, kind="stable")


def require_gate_prediction(trace: Trace) -> None:
    """Raise ConfigError unless ``trace`` records the speculative prediction the statistics need."""
    if trace.gate_prediction is None:
        raise ConfigError(f"{trace.path}: the trace has no gate_prediction column, and MoEpic's configurator "
                          "needs it to measure the speculative prefetcher's accuracy (paper 004, section 3.4.2); "
                          "record the trace with the next-layer gate prediction")


def measure_statistics(trace: Trace, *, omega: float = 128.0, rho: float = 0.25,
                       progress: Callable[[], None] | None = None) -> MoepicStatistics:
    """H, P and PH of ``trace`` with an LCP cache (parameters ``omega``, ``rho``, paper defaults).

    One replay per cache size C = 1..N; ``progress`` is called after each."""
    require_gate_prediction(trace)
    meta = trace.meta
    L, J, K = meta.num_layers, meta.num_experts, meta.top_k
    spec = ModelSpec(L, J, K)
    LCP(spec, omega=omega, rho=rho)  # checks omega and rho before the work, as any LCP does
    n = trace.num_tokens
    experts = trace.experts.astype(np.intp)

    activated = np.zeros((n, L, J), dtype=bool)
    np.put_along_axis(activated, experts, True, axis=2)
    order = predicted_order(trace.gate_prediction)
    accuracy = np.zeros((L, J))
    accuracy[1:] = np.take_along_axis(activated[:, 1:], order, axis=2).mean(axis=0)

    hit_rate = np.zeros((L, J + 1))
    prediction_hit_rate = np.zeros((L, J, J + 1))
    keys = (experts + (np.arange(L) * J)[None, :, None]).reshape(n, L * K).tolist()
    iterations, requests = trace.iteration.tolist(), trace.request.tolist()
    ctx = AccessContext()
    for size in range(1, J + 1):
        cache = PartitionedCache(size * L, L, lambda: LCP(spec, omega=omega, rho=rho), J)
        resident = np.zeros((n, L * J), dtype=bool)
        clock = 0
        for token, token_keys in enumerate(keys):
            resident[token, list(chain.from_iterable(part.resident for part in cache.parts))] = True
            ctx.token, ctx.iteration, ctx.request = token, iterations[token], requests[token]
            for key in token_keys:
                ctx.clock, ctx.layer = clock, key // J
                cache.request(key, ctx)
                clock += 1
        resident = resident.reshape(n, L, J)
        hit_rate[:, size] = (resident & activated).sum(axis=(0, 2)) / (n * K)
        prediction_hit_rate[1:, :, size] = np.take_along_axis(resident[:, 1:], order, axis=2).mean(axis=0)
        if progress is not None:
            progress()

    predicted = np.arange(L) > 0
    return MoepicStatistics(num_tokens=n, top_k=K, hit_rate=hit_rate, prediction_accuracy=accuracy,
                            prediction_hit_rate=prediction_hit_rate, predicted=predicted)
