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
token by token (``OnlineStatistics``, Algorithm 1 lines 6-7): an LCP cache of every size C = 1..N per layer
sees every token, so that H_i(C) is known for the sizes the run does not use; ``statistics()`` reads them after
any number of tokens (every tau tokens in the timed simulator's online loop), and ``measure_statistics`` feeds
a whole trace.

Every size in one pass. LCP ranks an expert by log P = log mu - nu * log(1/rho) / omega; the term of the
current token is common to all experts, so the order is that of log mu + t_last * log(1/rho) / omega (ties:
the earlier last request first, as policies/_ranked.py breaks them), which depends on the expert's own history
only, never on the size of the cache. LCP is therefore a priority stack algorithm (Mattson, Gecsei, Slutz and
Traiger, 1970): the cache of C experts always holds the first C entries of one stack per layer. A request of x
at depth p (infinite if x was never requested) puts x on top; walking down the stack from the top, the carried
entry is the lowest-priority expert of the cache above (the one a cache of that size evicts for x), and it
swaps with every entry of lower priority still, until it lands in x's old place (or at the bottom). So
"x is in the cache of C experts" is "depth(x) <= C", every size's hit is one depth, and a token costs
O(L K N) instead of N shadow caches' O(L K N log N) in Python. ``observe_tokens`` is that walk, compiled by
Numba when it is installed (it is the same function in Python without it); tests check it against N shadow
LCP caches of the shared cache (simulator/cache.py) on real traces.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from moe_offload.compiled import njit_cached, numba_available
from moe_offload.errors import ConfigError
from moe_offload.policies.base import ModelSpec
from moe_offload.policies.lcp import LCP
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
        # LCP's own checks of omega and rho, before any work; its decay, as its replay kernel computes it
        self.decay = float(LCP(ModelSpec(L, J, top_k), omega=omega, rho=rho).kernel_arguments()[0][0])
        self.tokens = 0
        self.clock = 0
        # one LCP stack per layer (module docstring): the experts from the top, and each expert's depth (0: never
        # requested) with what ranks it: mu, the token of its last activation, the clock of its last request
        self.stack = np.zeros((L, J), dtype=np.int64)
        self.depth = np.zeros(L, dtype=np.int64)
        self.position = np.zeros((L, J), dtype=np.int64)
        self.mu = np.zeros((L, J), dtype=np.int64)
        self.last_token = np.full((L, J), -1, dtype=np.int64)
        self.stamp = np.zeros((L, J), dtype=np.int64)
        self.score = np.zeros((L, J), dtype=np.float64)
        # counts by depth: a request found at depth p hits every cache of p experts or more
        self.hit_depths = np.zeros((L, J + 1), dtype=np.int64)             # [i, p]
        self.predicted_tokens = np.zeros(L, dtype=np.int64)               # q_i: tokens with a prediction of layer i
        self.activated_rank = np.zeros((L, J), dtype=np.int64)            # [i, y-1]: the y-th predicted was activated
        self.resident_depths = np.zeros((L, J, J + 1), dtype=np.int64)    # [i, y-1, p]: ... was found at depth p
        self._last: dict[int, tuple[int, int, np.ndarray | None]] = {}  # request -> (position, pass, prediction)

    def observe(self, trace: Trace, rows, iteration: int) -> None:
        """The tokens ``rows`` of ``trace`` ran in pass ``iteration``, in this order."""
        rows = np.asarray(rows)
        L, J = self.L, self.J
        experts = np.ascontiguousarray(trace.experts[rows], dtype=np.int64)
        requests, positions = trace.request[rows].tolist(), trace.position[rows].tolist()
        order = np.full((len(rows), L, J), -1, dtype=np.int64)  # -1: no prediction of that layer
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
        compiled_observe_tokens()(experts, order, self.tokens, self.clock, self.decay, self.stack, self.depth,
                                  self.position, self.mu, self.last_token, self.stamp, self.score, self.hit_depths,
                                  self.predicted_tokens, self.activated_rank, self.resident_depths)
        self.tokens += len(rows)
        self.clock += experts.size

    def log_priorities(self) -> np.ndarray:
        """[L, J] the log of every expert's cache priority P_ij = mu_ij rho^(nu_ij / omega) now (paper 004,
        equation 4: mu its activations so far, nu the tokens since its last), as LCP (policies/lcp.py) computes
        it; -inf for an expert never activated."""
        now = self.tokens - 1  # the last token observed: an expert it activated has nu = 0
        return np.array([[-math.inf if mu == 0 else math.log(mu) - (now - last) * self.decay
                          for mu, last in zip(mus, lasts)]
                         for mus, lasts in zip(self.mu.tolist(), self.last_token.tolist())])

    def statistics(self) -> MoepicStatistics:
        """H, P and PH of the tokens observed so far."""
        q = max(self.tokens, 1)
        per_layer = np.maximum(self.predicted_tokens, 1)
        hits = np.cumsum(self.hit_depths, axis=1)  # found at depth <= C: a hit of the cache of C experts
        resident = np.cumsum(self.resident_depths, axis=2)
        return MoepicStatistics(num_tokens=self.tokens, top_k=self.K, hit_rate=hits / (q * self.K),
                                prediction_accuracy=self.activated_rank / per_layer[:, None],
                                prediction_hit_rate=resident / per_layer[:, None, None],
                                predicted=self.predicted_tokens > 0)


def observe_tokens(experts, order, token0, clock0, decay, stack, depth, position, mu, last_token, stamp, score,
                   hit_depths, predicted_tokens, activated_rank, resident_depths):
    """The tokens ``experts`` [n, L, K] (their layers' predicted orders ``order`` [n, L, N], -1 for none),
    numbered from ``token0``, their requests from ``clock0``: each layer's depths are counted as the token
    finds them, then its requests walk the layer's LCP stack (module docstring)."""
    num_tokens, num_layers, top_k = experts.shape
    num_experts = stack.shape[1]
    clock = clock0
    for n in range(num_tokens):
        token = token0 + n
        for i in range(num_layers):
            if order[n, i, 0] >= 0:
                predicted_tokens[i] += 1
                for y in range(num_experts):
                    e = order[n, i, y]
                    for k in range(top_k):
                        if experts[n, i, k] == e:
                            activated_rank[i, y] += 1
                            break
                    if position[i, e] > 0:  # depth 0: never requested, in no cache
                        resident_depths[i, y, position[i, e]] += 1
            for k in range(top_k):
                if position[i, experts[n, i, k]] > 0:
                    hit_depths[i, position[i, experts[n, i, k]]] += 1
            for k in range(top_k):
                x = experts[n, i, k]
                if last_token[i, x] != token:  # several requests of one token are one activation
                    mu[i, x] += 1
                    last_token[i, x] = token
                score[i, x] = math.log(mu[i, x]) + last_token[i, x] * decay
                stamp[i, x] = clock
                clock += 1
                p = position[i, x]
                if p == 1:
                    continue
                if depth[i] == 0:
                    stack[i, 0] = x
                    position[i, x] = 1
                    depth[i] = 1
                    continue
                end = p - 1 if p > 0 else depth[i]  # x's old slot, or one past the bottom
                carry = stack[i, 0]
                stack[i, 0] = x
                position[i, x] = 1
                for j in range(1, end):  # carry: what the cache of j experts evicts for x
                    s = stack[i, j]
                    lower = score[i, s] < score[i, carry] or (score[i, s] == score[i, carry]
                                                              and stamp[i, s] < stamp[i, carry])
                    if lower:  # s is what the cache of j + 1 experts evicts for x; the carry settles here
                        stack[i, j] = carry
                        position[i, carry] = j + 1
                        carry = s
                stack[i, end] = carry
                position[i, carry] = end + 1
                if p == 0:
                    depth[i] += 1


@functools.cache
def compiled_observe_tokens():
    """``observe_tokens`` compiled (or loaded from Numba's cache), or the plain function without Numba."""
    if not numba_available():
        return observe_tokens
    from numba import types

    def array(dims):
        return types.Array(types.int64, dims, "C")

    signature = types.void(array(3), array(3), types.int64, types.int64, types.float64, array(2), array(1),
                           array(2), array(2), array(2), array(2), types.Array(types.float64, 2, "C"), array(2),
                           array(1), array(2), array(3))
    return njit_cached(observe_tokens, signature)


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
