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
  trained beforehand, so nothing is fitted to a trace.

Every probability is computed when it is read, with the counts as they are then (those of the finished
tokens): P and Q are sums over at most K experts, so a value costs at most 2K products where keeping P and Q
as sums would cost 2J additions per activation (J = 128 on Qwen3 or gpt-oss, K = 8: 16 times more, and the
replay's largest cost when it did). The counts are stored by their second expert: c(., b) and d(., b) are
rows of b, so the K counts a value reads lie in two rows, not in 2K rows of the tables (1.2x faster on the
report's 48 x 128 top-8 trace).

Why it is cheap. Every F decays by the same factor between two tokens, so the policy keeps F in a common
unit instead: s_e = F_e(n) * g_n with g_n = 2^((n - n_0) / h) for a base token n_0, so an activation at token
n adds g_n to s_e (no exp or log per request) and, within token n, V_e * g_n = s_e + g_n * (P_e + Q_e) ranks
the experts as V_e does. When g_n passes e^600 every s is divided by it and n_0 becomes n (an overflow guard;
one pass over the experts every 600 / lambda tokens, lambda = ln 2 / h). The residents sit in a keyed heap
(policies/_ranked.py) by (u_e, the clock of e's last request), u_e = g_n * V_e, each entry a lower bound of
its key, corrected lazily: the search reads the root's key as it is now and, if it has grown, re-keys it
(O(log C) for C residents) and reads the new root. A root whose entry is current is the lowest of all: every
other key is at least its entry, which is at least the root's. A resident is re-keyed at most once per
search. s_e is a lower bound of u_e at every token (P and Q are not negative), and the entry a resident gets
on entering; within a token no key shrinks but at an activation: s grows by activations, P and Q as their
layers route, the clock with each request; an activation raises s by g_n but ends the expert's P and Q,
which can together exceed 1, so a request lowers its expert's entry to s_e where it was above. A token's
start can lower any key (P starts again, Q is new): the entries a search raised above s_e in the token before
go back to s_e (a list of them is kept), so every entry is a lower bound again without computing any key;
when the unit changes (every 600 / lambda tokens) every entry is set to s_e, pushed again one by one. A
token's end costs 2 K^2 additions per layer to learn from it.

Two savings that change no decision. An entry known to be its key needs no value computed: a request changes
the keys of its own layer (s, the stamp, the Q of what the layer has routed) and, routing a new expert, P at
the next layer; a token's start changes every key. Each layer keeps the count of requests (events) at its
last change, and each entry the count after which it was set to its key's value; a root set after its
layer's last change is its key, so the search takes it without computing it (most searches end on a root they
have just re-keyed). And where Q is a large share of a key, K / J >= 1/8 (Q averages K / J an expert), a
token's start re-keys each raised entry to its value there, s_e + g_n * Q (P is 0 until the layer before
routes), where it is below the entry, instead of lowering it to s_e: K products that spare the searches of
the new token re-keying it from s_e; it stays on the list of raised entries while above s_e. On
``benchmarks/replay_throughput.py``'s 32 x 8 top-2 sequence (64 slots) the two took the kernel from 8.8 to
10.4 M requests/s; with more experts a layer (128, top-4 or top-8) the K products, each in another row of
the transition table, cost more than the re-keys they spare, hence the share.

Beyond the replay. A prefetched expert that no token has routed enters with F = 0. The runtime and the timed
simulator serve a whole pass per access; ``ctx.token`` then names its token and the counts learn per pass.
"""

from __future__ import annotations

import math

import numpy as np

from moe_offload.policies._coact_tokens import learn, new_token, tight_start
from moe_offload.policies._ranked import heap_new, heap_pop, heap_push, heap_remove, heap_replace_first, heap_update
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert
from moe_offload.values import number

HALF_LIFE = 8.0  # tokens


class CoActivation(EvictionPolicy):
    name = "coact"
    summary = ("evict the lowest decayed activation count (half-life 8 tokens) plus the probabilities that "
               "the previous layer's routing in this token and the layer's own in the last token give the expert")
    source = ("this project: LRFU (Lee et al. 2001) per token, plus cross-layer co-activation and same-layer "
              "token-to-token transitions (docs/policies/coact.md)")
    replay_cost = 40  # LRU replays a kernel run costs (base.py)

    def __init__(self, spec, seed=0, half_life: float = HALF_LIFE):
        super().__init__(spec, seed)
        self.half_life = number(half_life, "coact.half_life", low=0, low_open=True)
        self.decay = math.log(2.0) / self.half_life  # lambda
        num_keys = spec.num_layers * spec.num_experts
        self._scaled = np.zeros(num_keys)                         # s_e = F_e * g
        self._last_token = np.full(num_keys, -1, np.int64)
        self._last_request = np.zeros(num_keys, np.int64)     # the clock of each key's last request
        self._cooccur = np.zeros((num_keys, spec.num_experts), np.uint16)  # c(a, b): b's row, a's index in its layer
        self._routed = np.zeros(num_keys)                        # c(a)
        self._inverse_routed = np.zeros(num_keys)                # 1 / c(a), 0 while c(a) = 0
        self._successor = np.zeros((num_keys, spec.num_experts), np.uint16)  # d(a, b): b's row, a's index in the layer
        self._followed = np.zeros(num_keys)                          # d(a)
        self._inverse_followed = np.zeros(num_keys)                  # 1 / d(a), 0 while d(a) = 0
        # this token's and the last token's experts per layer, in request order (a runtime pass may route more
        # than K per layer)
        self._seen = np.zeros((spec.num_layers, spec.top_k), np.int64)
        self._seen_count = np.zeros(spec.num_layers, np.int64)
        self._before = np.zeros((spec.num_layers, spec.top_k), np.int64)
        self._before_count = np.zeros(spec.num_layers, np.int64)
        self._raised = np.zeros(num_keys, np.bool_)  # residents whose entry may be above s_e (module doc)
        self._raised_keys = np.zeros(num_keys, np.int64)
        self._raised_count = 0
        self._tight = tight_start(spec.num_experts, spec.top_k)
        # the event count at which each layer's keys last changed, and after which each entry is its key (doc)
        self._changed = np.zeros(spec.num_layers, np.int64)
        self._exact = np.zeros(num_keys, np.int64)
        self._events = 1
        self._token = None
        self._base = 0  # n_0
        self._scale = 1.0  # g_n
        # the kernel's heap (policies/_ranked.py) as Python lists: the same functions run on them several times
        # faster than on NumPy arrays, whose scalar reads box every value
        self._heap = tuple(array.tolist() for array in heap_new(num_keys, num_keys))
        self._size = 0

    def kernel_arguments(self):
        return np.array([self.decay], np.float64), np.array([self.spec.top_k], np.int64)

    def value(self, key, token) -> float:
        """V_e at the token being served, ``token`` (module doc), for reports and tests."""
        return self._value(key, token) / self._scale

    def _value(self, key, token) -> float:
        return _value_of(key, token, self._scaled, self._scale, self._last_token, self._cooccur,
                         self._inverse_routed, self._successor, self._inverse_followed, self._seen, self._seen_count,
                         self._before, self._before_count, self.spec.num_experts, self.spec.top_k)

    def on_access(self, key, ctx):
        token = ctx.token
        order, scores, stamps, position = self._heap
        if token != self._token:
            if self._token is not None:
                learn(self._cooccur, self._routed, self._inverse_routed, self._successor, self._followed,
                       self._inverse_followed, self._seen, self._seen_count, self._before, self._before_count,
                       self.spec.num_experts)
                self._seen, self._before = self._before, self._seen
                self._seen_count, self._before_count = self._before_count, self._seen_count
            self._seen_count[:] = 0
            self._events += 1
            self._changed[:] = self._events
            self._base, self._scale, self._raised_count = new_token(
                order, scores, stamps, position, self._size, token, self._scaled, self._last_request, self._raised,
                self._raised_keys, self._raised_count, self._base, self.decay, self._tight, self._successor,
                self._inverse_followed, self._before, self._before_count, self.spec.num_experts, self.spec.top_k,
                self._exact, self._events)
            self._token = token
        layer = key // self.spec.num_experts
        if self._last_token[key] != token:
            self._scaled[key] += self._scale
            self._last_token[key] = token
            if self._seen_count[layer] == self._seen.shape[1]:  # a runtime pass routed more than K
                self._seen = np.concatenate([self._seen, np.zeros_like(self._seen)], axis=1)
                self._before = np.concatenate([self._before, np.zeros_like(self._before)], axis=1)
            self._seen[layer, self._seen_count[layer]] = key
            self._seen_count[layer] += 1
            if layer + 1 < self.spec.num_layers:
                self._changed[layer + 1] = self._events + 1
        self._events += 1
        self._changed[layer] = self._events
        self._last_request[key] = ctx.clock
        if position[key] >= 0:
            _lower_on_hit(order, scores, stamps, position, self._size, key, float(self._scaled[key]), ctx.clock)

    def on_insert(self, key, ctx):
        order, scores, stamps, position = self._heap
        self._last_request[key] = ctx.clock  # a prefetch too: ties go to the expert loaded or requested last
        self._exact[key] = 0  # its entry s_e is a bound, whatever an earlier stay left
        heap_push(order, scores, stamps, position, self._size, key, float(self._scaled[key]), ctx.clock)
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
            victim = self._search(order, scores, stamps, position)
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

    def _search(self, order, scores, stamps, position):
        """The resident of lowest (u, stamp), left at the heap's root. An entry holds a lower bound of its key's
        (u, last request); a root whose entry is not current is re-keyed until the root's entry is current, and
        the lowest of all (module doc)."""
        while True:
            key = order[0]
            if self._exact[key] > self._changed[key // self.spec.num_experts] and \
                    self._last_request[key] == stamps[0]:
                return key
            value = self._value(key, self._token)
            self._exact[key] = self._events + 1
            if value == scores[0] and self._last_request[key] == stamps[0]:
                return key
            heap_update(order, scores, stamps, position, self._size, key, value, self._last_request[key])
            if not self._raised[key]:
                self._raised[key] = True
                self._raised_keys[self._raised_count] = key
                self._raised_count += 1

    def decision_flops(self, residents: int) -> float:
        """A value is at most 2K products and additions (P and Q) and four more operations: ``4 (K + 1)``. A
        search computes one at most once per resident it re-keys and once more for the victim:
        ``4 (K + 1) (residents + 1)``, an upper bound (most searches re-key a few); the heap's comparisons,
        and the lowering of the raised entries at a token's start, are bookkeeping."""
        return float(4 * (self.spec.top_k + 1) * (residents + 1))

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them, with the same arithmetic in the same order."""
        decay = floats[0]
        top_k = ints[0]
        num_keys = num_layers * num_experts
        order, scores, stamps, position = heap_new(capacity, num_keys)
        scaled = np.zeros(num_keys)
        last_token = np.full(num_keys, -1, np.int64)
        last_request = np.zeros(num_keys, np.int64)
        cooccur = np.zeros((num_keys, num_experts), np.uint16)
        routed = np.zeros(num_keys)
        inverse_routed = np.zeros(num_keys)
        successor = np.zeros((num_keys, num_experts), np.uint16)
        followed = np.zeros(num_keys)
        inverse_followed = np.zeros(num_keys)
        seen = np.zeros((num_layers, top_k), np.int64)
        seen_count = np.zeros(num_layers, np.int64)
        before = np.zeros((num_layers, top_k), np.int64)
        before_count = np.zeros(num_layers, np.int64)
        raised = np.zeros(num_keys, np.bool_)
        raised_keys = np.zeros(num_keys, np.int64)
        raised_count = 0
        tight = tight_start(num_experts, top_k)
        changed = np.zeros(num_layers, np.int64)
        exact = np.zeros(num_keys, np.int64)
        events = 1
        base = 0
        scale = 1.0
        current = -1
        size = 0
        for t in range(keys.shape[0]):
            key = keys[t]
            token = tokens[t]
            if token != current:
                if current >= 0:
                    learn(cooccur, routed, inverse_routed, successor, followed, inverse_followed, seen, seen_count,
                           before, before_count, num_experts)
                    before[:, :] = seen  # copied, not swapped: a swap of two arrays in the loop made it 4x slower
                    before_count[:] = seen_count
                seen_count[:] = 0
                events += 1
                changed[:] = events
                base, scale, raised_count = new_token(
                    order, scores, stamps, position, size, token, scaled, last_request, raised, raised_keys,
                    raised_count, base, decay, tight, successor, inverse_followed, before, before_count, num_experts,
                    top_k, exact, events)
                current = token
            layer = key // num_experts
            if last_token[key] != token:
                scaled[key] += scale
                last_token[key] = token
                if seen_count[layer] < top_k:
                    seen[layer, seen_count[layer]] = key
                    seen_count[layer] += 1
                if layer + 1 < num_layers:
                    changed[layer + 1] = events + 1
            events += 1
            changed[layer] = events
            last_request[key] = t
            if position[key] >= 0:
                key_hits[key] += 1
                if scaled[key] < scores[position[key]]:  # _lower_on_hit
                    heap_update(order, scores, stamps, position, size, key, scaled[key], t)
                continue
            if size == capacity:
                # _search, with _value_of written out: a helper with a loop takes a reference to each of its
                # arrays at every call (Numba counts them where it inlines one), which made this kernel 3 times
                # slower
                victim = order[0]
                while True:
                    layer = victim // num_experts
                    if exact[victim] > changed[layer] and last_request[victim] == stamps[0]:
                        break
                    first = layer * num_experts  # a's column: a - first for a of e's layer
                    if last_token[victim] != token:
                        predicted = 0.0
                        if layer > 0:
                            for i in range(seen_count[layer - 1]):
                                a = seen[layer - 1, i]
                                predicted += cooccur[victim, a - first + num_experts] * inverse_routed[a]
                        carried = 0.0
                        for i in range(before_count[layer]):
                            a = before[layer, i]
                            carried += successor[victim, a - first] * inverse_followed[a]
                        value = scaled[victim] + scale * ((predicted + carried) / top_k)
                    else:
                        following = 0.0
                        for i in range(seen_count[layer]):
                            a = seen[layer, i]
                            following += successor[victim, a - first] * inverse_followed[a]
                        value = scaled[victim] + scale * (following / top_k)
                    exact[victim] = events + 1
                    if value == scores[0] and last_request[victim] == stamps[0]:
                        break
                    heap_update(order, scores, stamps, position, size, victim, value, last_request[victim])
                    if not raised[victim]:
                        raised[victim] = True
                        raised_keys[raised_count] = victim
                        raised_count += 1
                    victim = order[0]
                exact[key] = 0
                heap_replace_first(order, scores, stamps, position, size, key, scaled[key], t)  # victim is first
                continue
            exact[key] = 0
            heap_push(order, scores, stamps, position, size, key, scaled[key], t)
            size += 1


def _value_of(key, token, scaled, scale, last_token, cooccur, inverse_routed, successor, inverse_followed, seen,
              seen_count, before, before_count, num_experts, top_k):
    """u_e = g_n * V_e of ``key`` at ``token`` (module doc): s_e + g_n * (P + Q) while the token has not routed
    e, with P over what the layer before has routed in it so far and Q over what e's layer routed in the
    token before; s_e + g_n * Q once it has, Q over what e's layer has routed in it so far. Each sum in the
    order its experts were routed."""
    layer = key // num_experts
    first = layer * num_experts  # a's column: a - first for a of e's layer
    if last_token[key] != token:
        predicted = 0.0
        if layer > 0:
            for i in range(seen_count[layer - 1]):
                a = seen[layer - 1, i]
                predicted += cooccur[key, a - first + num_experts] * inverse_routed[a]
        carried = 0.0
        for i in range(before_count[layer]):
            a = before[layer, i]
            carried += successor[key, a - first] * inverse_followed[a]
        return scaled[key] + scale * ((predicted + carried) / top_k)
    following = 0.0
    for i in range(seen_count[layer]):
        a = seen[layer, i]
        following += successor[key, a - first] * inverse_followed[a]
    return scaled[key] + scale * (following / top_k)


def _lower_on_hit(order, scores, stamps, position, size, key, value, clock):
    """A resident was requested: its entry is re-keyed only if its u fell below it (a search re-keys it when
    it reaches the root otherwise)."""
    if value < scores[position[key]]:
        heap_update(order, scores, stamps, position, size, key, value, clock)
