"""Co-activation: evict the expert least likely to be used soon, estimated from its decayed activation count,
from what the layer before it has just routed, and from what its own layer routed in the token before.

The estimate. Belady evicts the expert whose next use is furthest; an online policy can only rank by an
estimate of how soon each expert is used again. For an expert used at a rate rho (activations per token) the
expected wait is 1/rho, so evicting the lowest rate estimate approximates Belady. Three things estimate it:

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
  layer: a distribution of K choices);
* the token before, at the same layer. Consecutive tokens share experts (a routing drifts slowly), and which
  ones a layer keeps is learned the same way: with d(a, b) the pairs of consecutive tokens (m, m+1) in which
  layer l routed a in m and b in m+1, and d(a) the pairs whose first token routed a, the choice S' of layer l
  in one token gives each expert b of layer l the probability

      Q(b | S') = (1/K) * sum over a in S' of d(a, b) / d(a)

  of being routed there in the next token.

  An activation counts 1 in F, so a predicted activation counts its probability. Each expert's value is

      V_e = F_e(n) + P(e | S_{l-1}) + Q(e | S'_l)   while token n has not routed e,
      V_e = F_e(n) + Q(e | S_l)                      once it has (its next use is in a later token),

  where S_{l-1} is what layer l-1 has routed in token n so far (P is 0 at layer 0), S'_l what layer l
  routed in token n-1, and S_l what it has routed in token n so far: the evidence for the token after. P
  and Q are two estimates, from independent evidence, of one probability; they are added, not averaged, so
  that each counts as the activation it predicts and an expert both name ranks above one only one names.
  The victim is the resident with the lowest V_e; ties go to the one requested least recently (online: the
  requests already seen). The counts are learned online, from every token once it is over: nothing is
  trained beforehand, so nothing is fitted to a trace. Q for token n+1 is the sum built during token n, with
  the counts as they were then: the next token starts from it at no cost.

Why it is cheap. Every F decays by the same factor between two tokens, so the policy keeps F in a common
unit instead: s_e = F_e(n) * g_n with g_n = 2^((n - n_0) / h) for a base token n_0, so an activation at token
n adds g_n to s_e (no exp or log per request) and, within token n, V_e * g_n = s_e + g_n * (P_e + Q_e) ranks
the experts as V_e does. When g_n passes e^600 every s is divided by it and n_0 becomes n (an overflow guard;
one pass over the experts every 600 / lambda tokens, lambda = ln 2 / h). The residents sit in a keyed heap
(policies/_ranked.py) by (u_e, the clock of e's last request), u_e = g_n * V_e. A token's start changes every
key (Q is new, P back to 0), so the heap is rebuilt then, every resident pushed with its key as it is (C
pushes, for C residents, in the order of the old heap, which the new keys mostly keep). Within a token no key
shrinks but at an activation: s grows by activations, P and Q as their layers route, the clock with each
request; an activation raises s by g_n but ends the expert's P and Q, which can together exceed 1, so a
request lowers its expert's entry to s_e where it was above. Every other entry is the key as it was when it
was set, a lower bound, and the heap is corrected lazily: the search reads the root's key as it is now and,
if it has grown, re-keys it (O(log C)) and reads the new root. A root whose entry is current is the lowest of
all: every other key is at least its entry, which is at least the root's. A resident is re-keyed at most once
per search. A request costs an addition and, if it activates its expert, 2J additions and divisions (P of
the next layer, Q of its own); a token's end costs 2 K^2 additions per layer to learn from it and the C
pushes, fewer heap moves than re-keying lazily the residents whose Q changed, most of them.

Beyond the replay. A prefetched expert that no token has routed enters with F = 0. The runtime and the timed
simulator serve a whole pass per access; ``ctx.token`` then names its token and the counts learn per pass.
"""

from __future__ import annotations

import math

import numpy as np

from moe_offload.policies._ranked import heap_new, heap_pop, heap_push, heap_remove, heap_update
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert
from moe_offload.values import number

HALF_LIFE = 8.0  # tokens
RESCALE_EXPONENT = 600.0  # ln g at which the common unit moves to the current token (e^709 overflows)


class CoActivation(EvictionPolicy):
    name = "coact"
    summary = ("evict the lowest decayed activation count (half-life 8 tokens) plus the probabilities that "
               "the previous layer's routing in this token and the layer's own in the last token give the expert")
    source = ("this project: LRFU (Lee et al. 2001) per token, plus cross-layer co-activation and same-layer "
              "token-to-token transitions (docs/policies/coact.md)")

    def __init__(self, spec, seed=0, half_life: float = HALF_LIFE):
        super().__init__(spec, seed)
        self.half_life = number(half_life, "coact.half_life", low=0, low_open=True)
        self.decay = math.log(2.0) / self.half_life  # lambda
        num_keys = spec.num_layers * spec.num_experts
        self._scaled = np.zeros(num_keys)                         # s_e = F_e * g
        self._last_token = np.full(num_keys, -1, np.int64)
        self._last_request = np.zeros(num_keys, np.int64)     # the clock of each key's last request
        self._cooccur = np.zeros((num_keys, spec.num_experts))  # c(a, b): a's row, b's index in its layer
        self._routed = np.zeros(num_keys)                        # c(a)
        self._successor = np.zeros((num_keys, spec.num_experts))  # d(a, b): a's row, b's index in the layer
        self._followed = np.zeros(num_keys)                          # d(a)
        # this token's and the last token's experts per layer, in request order (a runtime pass may route more
        # than K per layer)
        self._seen = np.zeros((spec.num_layers, spec.top_k), np.int64)
        self._seen_count = np.zeros(spec.num_layers, np.int64)
        self._before = np.zeros((spec.num_layers, spec.top_k), np.int64)
        self._before_count = np.zeros(spec.num_layers, np.int64)
        self._predicted_sum = np.zeros(num_keys)  # K * P: sum over a in S_{l-1} of c(a, b) / c(a), for each b
        self._carried_sum = np.zeros(num_keys)    # K * Q(b | S'_l), from the last token
        self._following_sum = np.zeros(num_keys)  # K * Q(b | S_l), for the next token, built as layer l routes
        self._token = None
        self._base = 0  # n_0
        self._scale = 1.0  # g_n
        # the kernel's heap (policies/_ranked.py) as Python lists: the same functions run on them several times
        # faster than on NumPy arrays, whose scalar reads box every value
        self._heap = tuple(array.tolist() for array in heap_new(num_keys, num_keys))
        self._size = 0
        self._scratch = [0] * num_keys  # _new_token's room

    def kernel_arguments(self):
        return np.array([self.decay], np.float64), np.array([self.spec.top_k], np.int64)

    def value(self, key, token) -> float:
        """V_e at the token being served, ``token`` (module doc), for reports and tests."""
        return _value_of(token, self._scaled[key], self._scale, self._last_token[key], self._predicted_sum[key],
                         self._carried_sum[key], self._following_sum[key], self.spec.top_k) / self._scale

    def on_access(self, key, ctx):
        token = ctx.token
        order, scores, stamps, position = self._heap
        if token != self._token:
            if self._token is not None:
                _learn(self._cooccur, self._routed, self._successor, self._followed, self._seen, self._seen_count,
                       self._before, self._before_count, self.spec.num_experts)
                self._seen, self._before = self._before, self._seen
                self._seen_count, self._before_count = self._before_count, self._seen_count
                self._carried_sum, self._following_sum = self._following_sum, self._carried_sum
            self._seen_count[:] = 0
            self._predicted_sum[:] = 0.0
            self._following_sum[:] = 0.0
            self._base, self._scale = _new_token(
                order, scores, stamps, position, self._size, token, self._scaled, self._last_token,
                self._last_request, self._predicted_sum, self._carried_sum, self._following_sum, self.spec.top_k,
                self._base, self.decay, self._scratch)
            self._token = token
        if self._last_token[key] != token:
            self._scaled[key] += self._scale
            self._last_token[key] = token
            layer = key // self.spec.num_experts
            if self._seen_count[layer] == self._seen.shape[1]:
                self._seen = np.concatenate([self._seen, np.zeros_like(self._seen)], axis=1)
            self._seen[layer, self._seen_count[layer]] = key
            self._seen_count[layer] += 1
            J = self.spec.num_experts
            if layer + 1 < self.spec.num_layers and self._routed[key] > 0:  # + c(key, b) / c(key), next layer
                self._predicted_sum[(layer + 1) * J:(layer + 2) * J] += self._cooccur[key] / self._routed[key]
            if self._followed[key] > 0:  # + d(key, b) / d(key), its own layer in the next token
                self._following_sum[layer * J:(layer + 1) * J] += self._successor[key] / self._followed[key]
        self._last_request[key] = ctx.clock
        if position[key] >= 0:
            _lower_on_hit(order, scores, stamps, position, self._size, key, float(self._scaled[key]), ctx.clock)

    def on_insert(self, key, ctx):
        order, scores, stamps, position = self._heap
        value = _value_of(self._token, self._scaled[key], self._scale, self._last_token[key],
                          self._predicted_sum[key], self._carried_sum[key], self._following_sum[key],
                          self.spec.top_k)
        self._last_request[key] = ctx.clock  # a prefetch too: ties go to the expert loaded or requested last
        heap_push(order, scores, stamps, position, self._size, key, value, ctx.clock)
        self._size += 1

    def on_evict(self, key):
        order, scores, stamps, position = self._heap
        heap_remove(order, scores, stamps, position, self._size, key)
        self._size -= 1

    def victim(self, ctx):
        """The lowest (u, stamp) not pinned: pinned roots are taken out while the search goes on below them,
        then put back as they were."""
        order, scores, stamps, position = self._heap
        set_aside = []
        victim = -1
        while self._size > 0:
            victim = _search(order, scores, stamps, position, self._size, self._token, self._scaled, self._scale,
                             self._last_token, self._last_request, self._predicted_sum, self._carried_sum,
                             self._following_sum, self.spec.top_k)
            if victim not in ctx.pinned:
                break
            set_aside.append((victim, scores[0], stamps[0]))
            heap_pop(order, scores, stamps, position, self._size)
            self._size -= 1
            victim = -1
        for key, score, stamp in set_aside:
            heap_push(order, scores, stamps, position, self._size, key, score, stamp)
            self._size += 1
        if victim < 0:
            raise NoEvictableExpert
        return int(victim)

    def decision_flops(self, residents: int) -> float:
        """A search recomputes the value of its root, two additions, a product and a division (4 FLOPs), at
        most once per resident it re-keys and once more for the victim: ``4 * (residents + 1)``, an upper
        bound (most searches re-key a few); the heap's comparisons are bookkeeping."""
        return float(4 * (residents + 1))

    @staticmethod
    def replay_kernel(keys, clocks, tokens, next_use, capacity, num_layers, num_experts, floats, ints,
                      layer_hits):
        """The hooks above as the compiled replay runs them, with the same arithmetic in the same order."""
        decay = floats[0]
        top_k = ints[0]
        num_keys = num_layers * num_experts
        order, scores, stamps, position = heap_new(capacity, num_keys)
        scaled = np.zeros(num_keys)
        last_token = np.full(num_keys, -1, np.int64)
        last_request = np.zeros(num_keys, np.int64)
        cooccur = np.zeros((num_keys, num_experts))
        routed = np.zeros(num_keys)
        successor = np.zeros((num_keys, num_experts))
        followed = np.zeros(num_keys)
        seen = np.zeros((num_layers, top_k), np.int64)
        seen_count = np.zeros(num_layers, np.int64)
        before = np.zeros((num_layers, top_k), np.int64)
        before_count = np.zeros(num_layers, np.int64)
        predicted_sum = np.zeros(num_keys)
        carried_sum = np.zeros(num_keys)
        following_sum = np.zeros(num_keys)
        scratch = np.empty(max(capacity, 1), np.int64)
        base = 0
        scale = 1.0
        current = -1
        size = 0
        for t in clocks:
            key = keys[t]
            token = tokens[t]
            if token != current:
                if current >= 0:
                    _learn(cooccur, routed, successor, followed, seen, seen_count, before, before_count,
                           num_experts)
                    before[:, :] = seen  # copied, not swapped: a swap of two arrays in the loop made it 4x slower
                    before_count[:] = seen_count
                    carried_sum[:] = following_sum
                seen_count[:] = 0
                predicted_sum[:] = 0.0
                following_sum[:] = 0.0
                base, scale = _new_token(order, scores, stamps, position, size, token, scaled, last_token,
                                         last_request, predicted_sum, carried_sum, following_sum, top_k, base,
                                         decay, scratch)
                current = token
            if last_token[key] != token:
                scaled[key] += scale
                last_token[key] = token
                layer = key // num_experts
                if seen_count[layer] < top_k:
                    seen[layer, seen_count[layer]] = key
                    seen_count[layer] += 1
                    if layer + 1 < num_layers and routed[key] > 0:  # on_access's P of the next layer
                        first = (layer + 1) * num_experts
                        for j in range(num_experts):
                            predicted_sum[first + j] += cooccur[key, j] / routed[key]
                    if followed[key] > 0:  # on_access's Q of the next token
                        first = layer * num_experts
                        for j in range(num_experts):
                            following_sum[first + j] += successor[key, j] / followed[key]
            last_request[key] = t
            if position[key] >= 0:
                layer_hits[key // num_experts] += 1
                if scaled[key] < scores[position[key]]:  # _lower_on_hit
                    heap_update(order, scores, stamps, position, size, key, scaled[key], t)
                continue
            if size == capacity:
                # _search, written out: a helper with a loop takes a reference to each of its arrays at every
                # call (Numba counts them where it inlines one), which made this kernel 3 times slower
                victim = order[0]
                value = _value_of(token, scaled[victim], scale, last_token[victim], predicted_sum[victim],
                                  carried_sum[victim], following_sum[victim], top_k)
                while value != scores[0] or last_request[victim] != stamps[0]:
                    heap_update(order, scores, stamps, position, size, victim, value, last_request[victim])
                    victim = order[0]
                    value = _value_of(token, scaled[victim], scale, last_token[victim], predicted_sum[victim],
                                      carried_sum[victim], following_sum[victim], top_k)
                # the request takes the victim's place at the root and sifts down: one sift, not a pop and a push
                position[victim] = -1
                position[key] = 0
                heap_update(order, scores, stamps, position, size, key, scaled[key], t)
                continue
            heap_push(order, scores, stamps, position, size, key, scaled[key], t)
            size += 1


def _value_of(token, scaled, scale, last_token, predicted_sum, carried_sum, following_sum, top_k):
    """u_e = g_n * V_e (module doc) from the expert's own numbers (scalars: the kernel's form, no array to count
    references to): s_e + g_n * (P + Q) while ``token`` has not routed e, s_e + g_n * Q(next token) once it has."""
    if last_token != token:
        return scaled + scale * ((predicted_sum + carried_sum) / top_k)
    return scaled + scale * (following_sum / top_k)


def _search(order, scores, stamps, position, size, token, scaled, scale, last_token, last_request, predicted_sum,
            carried_sum, following_sum, top_k):
    """The resident of lowest (u, stamp), left at the heap's root. An entry holds a lower bound of its key's
    (u, last request); a root whose entry is not current is re-keyed until the root's entry is current, and
    the lowest of all (module doc)."""
    key = order[0]
    value = _value_of(token, scaled[key], scale, last_token[key], predicted_sum[key], carried_sum[key],
                      following_sum[key], top_k)
    while value != scores[0] or last_request[key] != stamps[0]:
        heap_update(order, scores, stamps, position, size, key, value, last_request[key])
        key = order[0]
        value = _value_of(token, scaled[key], scale, last_token[key], predicted_sum[key], carried_sum[key],
                          following_sum[key], top_k)
    return key


def _lower_on_hit(order, scores, stamps, position, size, key, value, clock):
    """A resident was requested: its entry is re-keyed only if its u fell below it (a search re-keys it when
    it reaches the root otherwise)."""
    if value < scores[position[key]]:
        heap_update(order, scores, stamps, position, size, key, value, clock)


def _new_token(order, scores, stamps, position, size, token, scaled, last_token, last_request, predicted_sum,
               carried_sum, following_sum, top_k, base, decay, scratch):
    """(n_0, g_n) for the token ``token`` starting now, whose predictions are set: when ln g_n passes
    RESCALE_EXPONENT every s_e is divided by g_n, which then becomes 1 (module doc); then the heap is rebuilt
    with every resident's key as it is at the token's start (``scratch`` has room for ``size`` keys)."""
    exponent = decay * (token - base)
    if exponent > RESCALE_EXPONENT:
        factor = math.exp(exponent)
        for key in range(scaled.shape[0]):
            scaled[key] = scaled[key] / factor
        base = token
        exponent = 0.0
    scale = math.exp(exponent)
    for i in range(size):
        scratch[i] = order[i]
        position[order[i]] = -1
    for i in range(size):
        key = scratch[i]
        heap_push(order, scores, stamps, position, i, key,
                  _value_of(token, scaled[key], scale, last_token[key], predicted_sum[key], carried_sum[key],
                            following_sum[key], top_k), last_request[key])
    return base, scale


def _learn(cooccur, routed, successor, followed, seen, seen_count, before, before_count, num_experts):
    """Count the finished token: c(a) for every routed a, c(a, b) for a at layer l and b at layer l + 1, and
    d(a), d(a, b) for a routed at layer l in the token before (``before``) and b at layer l in this one."""
    num_layers = seen_count.shape[0]
    for layer in range(num_layers):
        for i in range(seen_count[layer]):
            a = seen[layer, i]
            routed[a] += 1.0
            if layer + 1 < num_layers:
                for j in range(seen_count[layer + 1]):
                    cooccur[a, seen[layer + 1, j] % num_experts] += 1.0
        for i in range(before_count[layer]):
            a = before[layer, i]
            followed[a] += 1.0
            for j in range(seen_count[layer]):
                successor[a, seen[layer, j] % num_experts] += 1.0
