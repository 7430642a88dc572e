"""Co-activation: evict the expert least likely to be used soon, estimated from its decayed activation count
and from what the layer before it has just routed.

The estimate. Belady evicts the expert whose next use is furthest; an online policy can only rank by an
estimate of how soon each expert is used again. For an expert used at a rate rho (activations per token) the
expected wait is 1/rho, so evicting the lowest rate estimate approximates Belady. Two things estimate it:

* its own past, as a count of the tokens that activated it, each weighed by how long ago (LRFU's combined
  recency and frequency, Lee et al., IEEE ToC 2001, with time counted in tokens, as paper 004's LCP counts
  it, since a token's several requests of one expert are one routing decision):

      F_e(n) = sum over the tokens n_i <= n that activated e of 2^(-(n - n_i) / h)

  with half-life h tokens (option ``half_life``, default 8: a routing drifts over tens of tokens, so the
  estimate follows it within a few; ``benchmarks/policy_heldout.py`` chooses h leave-one-trace-out and
  shows the choice);
* the token being served. A token's expert at layer l-1 predicts its experts at layer l (the co-activation
  that pre-gated and Mixtral-offloading prefetchers exploit). With c(a, b) the tokens in which a (layer l-1)
  and b (layer l) were both routed, and c(a) the tokens that routed a, the router's choice S of layer l-1
  gives each expert b of layer l the probability

      P(b | S) = (1/K) * sum over a in S of c(a, b) / c(a)

  of being routed at layer l in this token (each c(a, .) / c(a) sums to K over b, so P sums to K over the
  layer: a distribution of K choices). An expert not yet routed in this token is worth its expected
  activation here on top of its past: an activation now counts 1 in F, so the prediction counts P.

  Each expert's value is V_e = F_e(n) + P(e | S_{l-1}) where the token n has not routed e yet (0 for
  layer 0, and 0 once e has been routed in n: its next use is in a later token), and the victim is the
  resident with the lowest V_e; ties go to the one whose F was set earliest. S_{l-1} is what layer l-1's
  router has chosen in token n so far (online: the requests already seen). The counts are learned online,
  from every token once it is over: nothing is trained beforehand, so nothing is fitted to a trace.

Why it is cheap. F decays by the same factor for every expert between two tokens, so its order only
changes when an expert is activated: the ranking key a_e = ln F_e(n_e) + lambda * n_e (n_e its last token,
lambda = ln 2 / h) is fixed between e's activations, and F_e(n) = exp(a_e - lambda * n) (the same trick as
``lcp.py`` and ``decayed_lfu.py``). The residents sit in a keyed heap by a_e. P only raises a value (P >= 0),
so the search walks the heap from its root and skips every subtree whose root's F already exceeds the best V
found so far: it reads the residents whose F is below the lowest V (few while the counts are young, more once
the predictions are of the size of the decayed counts), changes nothing, and the victim leaves the heap in
O(log n). The sums of P are kept as the layer routes: J additions per activation (the next layer's experts),
so an expert examined costs an exp and a division. Learning a finished token costs K^2 additions per layer.

Beyond the replay. A prefetched expert that no token has routed enters with F = 0. The runtime and the timed
simulator serve a whole pass per access; ``ctx.token`` then names its token and the counts learn per pass.
"""

from __future__ import annotations

import math

import numpy as np

from moe_offload.policies._ranked import heap_new, heap_push, heap_update
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert
from moe_offload.values import number

HALF_LIFE = 8.0  # tokens


class CoActivation(EvictionPolicy):
    name = "coact"
    summary = ("evict the lowest decayed activation count (half-life 8 tokens) plus the probability that "
               "the previous layer's routing gives the expert in this token")
    source = "this project: LRFU (Lee et al. 2001) per token, plus cross-layer co-activation (docs/policies/coact.md)"

    def __init__(self, spec, seed=0, half_life: float = HALF_LIFE):
        super().__init__(spec, seed)
        self.half_life = number(half_life, "coact.half_life", low=0, low_open=True)
        self.decay = math.log(2.0) / self.half_life  # lambda
        num_keys = spec.num_layers * spec.num_experts
        self._rank = np.full(num_keys, -math.inf)            # a_e; -inf: never activated
        self._last_token = np.full(num_keys, -1, np.int64)
        self._cooccur = np.zeros((num_keys, spec.num_experts))  # c(a, b): a's row, b's index in its layer
        self._routed = np.zeros(num_keys)                        # c(a)
        # this token's experts per layer, in request order (a runtime pass may route more than K per layer)
        self._seen = np.zeros((spec.num_layers, spec.top_k), np.int64)
        self._seen_count = np.zeros(spec.num_layers, np.int64)
        self._predicted_sum = np.zeros(num_keys)  # sum over a in S_{l-1} of c(a, b) / c(a), for each b
        self._token = None
        # the kernel's heap (policies/_ranked.py) and _search's stack, as Python lists: the same functions run
        # on them several times faster than on NumPy arrays, whose scalar reads box every value
        self._heap = tuple(array.tolist() for array in heap_new(num_keys, num_keys))
        self._size = 0
        self._stack = [0] * num_keys

    def kernel_arguments(self):
        return np.array([self.decay], np.float64), np.array([self.spec.top_k], np.int64)

    def value(self, key, token) -> float:
        """V_e at ``token`` (module doc), for reports and tests."""
        return (math.exp(self._rank[key] - self.decay * token)
                + _predicted(key, token, self._last_token, self._predicted_sum, self.spec.num_experts, self.spec.top_k))

    def on_access(self, key, ctx):
        token = ctx.token
        if token != self._token:
            if self._token is not None:
                _learn(self._cooccur, self._routed, self._seen, self._seen_count, self.spec.num_experts)
            self._seen_count[:] = 0
            self._predicted_sum[:] = 0.0
            self._token = token
        if self._last_token[key] != token:
            self._rank[key] = _activated(self._rank[key], token, self.decay)
            self._last_token[key] = token
            layer = key // self.spec.num_experts
            if self._seen_count[layer] == self._seen.shape[1]:
                self._seen = np.concatenate([self._seen, np.zeros_like(self._seen)], axis=1)
            self._seen[layer, self._seen_count[layer]] = key
            self._seen_count[layer] += 1
            if layer + 1 < self.spec.num_layers and self._routed[key] > 0:  # _predict_next, vectorised alike
                J = self.spec.num_experts
                self._predicted_sum[(layer + 1) * J:(layer + 2) * J] += self._cooccur[key] / self._routed[key]
        order, scores, stamps, position = self._heap
        if position[key] >= 0:
            heap_update(order, scores, stamps, position, self._size, key, float(self._rank[key]), ctx.clock)

    def on_insert(self, key, ctx):
        order, scores, stamps, position = self._heap
        heap_push(order, scores, stamps, position, self._size, key, float(self._rank[key]), ctx.clock)
        self._size += 1

    def on_evict(self, key):
        order, scores, stamps, position = self._heap
        _heap_remove(order, scores, stamps, position, self._size, key)
        self._size -= 1

    def victim(self, ctx):
        order, scores, stamps, position = self._heap
        victim = _search(order, scores, stamps, position, self._size, ctx.token, self.decay, self._last_token,
                         self._predicted_sum, self.spec.num_experts, self.spec.top_k,
                         np.array(sorted(ctx.pinned), np.int64), self._stack)
        if victim < 0:
            raise NoEvictableExpert
        return int(victim)

    def decision_flops(self, residents: int) -> float:
        """At most every resident is examined: the exp of its key (counted as 1), the division of its
        prediction by K and the sum: 3 each. An upper bound: the search skips most of the heap."""
        return float(residents * 3)

    @staticmethod
    def replay_kernel(keys, clocks, tokens, next_use, capacity, num_layers, num_experts, floats, ints,
                      layer_hits):
        """The hooks above as the compiled replay runs them, with the same arithmetic in the same order."""
        decay = floats[0]
        top_k = ints[0]
        num_keys = num_layers * num_experts
        order, scores, stamps, position = heap_new(capacity, num_keys)
        rank = np.full(num_keys, -math.inf)
        last_token = np.full(num_keys, -1, np.int64)
        cooccur = np.zeros((num_keys, num_experts))
        routed = np.zeros(num_keys)
        seen = np.zeros((num_layers, top_k), np.int64)
        seen_count = np.zeros(num_layers, np.int64)
        predicted_sum = np.zeros(num_keys)
        no_pins = np.zeros(0, np.int64)
        stack = np.empty(max(capacity, 1), np.int64)
        current = -1
        resident = np.zeros(num_keys, np.bool_)
        size = 0
        for t in clocks:
            key = keys[t]
            token = tokens[t]
            if token != current:
                if current >= 0:
                    _learn(cooccur, routed, seen, seen_count, num_experts)
                seen_count[:] = 0
                predicted_sum[:] = 0.0
                current = token
            if last_token[key] != token:
                rank[key] = _activated(rank[key], token, decay)
                last_token[key] = token
                layer = key // num_experts
                if seen_count[layer] < top_k:
                    seen[layer, seen_count[layer]] = key
                    seen_count[layer] += 1
                    if layer + 1 < num_layers and routed[key] > 0:
                        _predict_next(predicted_sum, cooccur, routed, key, layer, num_experts)
            if resident[key]:
                layer_hits[key // num_experts] += 1
                heap_update(order, scores, stamps, position, size, key, rank[key], t)
                continue
            if size == capacity:
                victim = _search(order, scores, stamps, position, size, token, decay, last_token, predicted_sum,
                                 num_experts, top_k, no_pins, stack)
                _heap_remove(order, scores, stamps, position, size, victim)
                resident[victim] = False
                size -= 1
            heap_push(order, scores, stamps, position, size, key, rank[key], t)
            resident[key] = True
            size += 1


def _activated(rank, token, decay):
    """The ranking key after an activation at ``token``: F = 1 + F decayed to ``token``."""
    return decay * token + math.log(1.0 + math.exp(rank - decay * token))


def _learn(cooccur, routed, seen, seen_count, num_experts):
    """Count the finished token: c(a) for every routed a, c(a, b) for a at layer l and b at layer l + 1."""
    num_layers = seen_count.shape[0]
    for layer in range(num_layers):
        for i in range(seen_count[layer]):
            a = seen[layer, i]
            routed[a] += 1.0
            if layer + 1 < num_layers:
                for j in range(seen_count[layer + 1]):
                    cooccur[a, seen[layer + 1, j] % num_experts] += 1.0


def _predict_next(predicted_sum, cooccur, routed, key, layer, num_experts):
    """Layer ``layer`` routed ``key`` in this token: add c(key, b) / c(key) to every b of the next layer."""
    first = (layer + 1) * num_experts
    for j in range(num_experts):
        predicted_sum[first + j] += cooccur[key, j] / routed[key]


def _predicted(key, token, last_token, predicted_sum, num_experts, top_k):
    """P(key | S_{l-1}) of the module doc: 0 for layer 0 and for an expert ``token`` has already routed."""
    if key < num_experts or last_token[key] == token:
        return 0.0
    return predicted_sum[key] / top_k


def _heap_remove(order, scores, stamps, position, size, key):
    """Take ``key`` out of a heap of ``size`` keys (then ``size - 1``), wherever it sits: the last entry fills
    its place and sifts to where it belongs."""
    i = position[key]
    position[key] = -1
    last = size - 1
    if i != last:
        moved = order[last]
        position[moved] = i
        heap_update(order, scores, stamps, position, last, moved, scores[last], stamps[last])


def _search(order, scores, stamps, position, size, token, decay, last_token, predicted_sum, num_experts, top_k,
            pinned, stack):
    """The resident of lowest V (module doc), ties to the lowest (key a_e, stamp), none of ``pinned`` (sorted);
    -1 if every resident is pinned. V >= F, and F grows down every path of the heap, so a subtree whose root's
    F exceeds the best V so far holds no better victim: the search walks the heap from its root (``stack``:
    scratch room for ``size`` positions) and skips those subtrees, changing nothing."""
    best = -1
    best_value = math.inf
    best_score = math.inf
    best_stamp = 0
    best_log = math.inf
    stack[0] = 0
    depth = 1 if size > 0 else 0
    while depth > 0:
        depth -= 1
        i = stack[depth]
        exponent = scores[i] - decay * token
        if exponent > best_log + 1e-9:  # F > best V, without an exp (1e-9: well above log's rounding)
            continue
        base = math.exp(exponent)
        if base > best_value:
            continue
        key = order[i]
        if not (pinned.shape[0] > 0 and _contains(pinned, key)):
            value = base + _predicted(key, token, last_token, predicted_sum, num_experts, top_k)
            if (value < best_value or (value == best_value and (scores[i] < best_score or (
                    scores[i] == best_score and stamps[i] < best_stamp)))):
                best, best_value, best_score, best_stamp = key, value, scores[i], stamps[i]
                best_log = math.log(value) if value > 0 else -math.inf
        for child in (2 * i + 1, 2 * i + 2):
            if child < size:
                stack[depth] = child
                depth += 1
    return best


def _contains(sorted_keys, key):
    i = np.searchsorted(sorted_keys, key)
    return i < sorted_keys.shape[0] and sorted_keys[i] == key
