"""FlashMoE's learned eviction (paper 003, section 3.2, Algorithm 1, Table 1).

Every cached expert is described by its recency r (time steps since it was last routed, r = 1 when it
was routed in the current step; a time step is one token, ``ctx.token``) and its frequency f (tokens in
which it was routed so far, kept across evictions). The network sees [1/r, f / max f], max f being the
largest frequency of any expert so far, and predicts a "routing distance"; on a miss with a full cache
the resident expert with the HIGHEST predicted distance is evicted (the paper's ``cache.MaxDist``).
Equal scores (equal inputs) are broken by the older last request (LRU). The network (3 linear layers,
hidden 128, SiLU) is trained by moe_offload.training.learned_eviction to reproduce Belady's choices:
its target keeps the order of the residents' next uses at every size of cache (learned_model.TARGETS).
A per-layer model (the paper's "per-layer ML cache FFN") scores each expert with its MoE layer's
network; inference here is NumPy only.

The shipped model, src/moe_offload/data/learned-eviction.npz, was made by the command in
src/moe_offload/data/NOTICE.md.

Speed: scores are kept for the resident experts and recomputed lazily, at the next eviction: all of them
in one batched forward pass when the token advanced or max f changed (every recency or every
normalised frequency moved), otherwise only those requested or inserted since the last eviction. The
network is evaluated once per distinct (r, f, network) triple (a memo valid while max f stays the same),
which also makes equal inputs get bit-identical scores. The residents sit in a heap ordered by (-score,
last request), rebuilt at each full rescoring and updated lazily in between, so a victim costs O(log n).
"""

from __future__ import annotations

import heapq

import numpy as np

from moe_offload import bundled
from moe_offload.errors import ConfigError
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert
from moe_offload.policies.learned_model import LearnedModel, features, load_model
from moe_offload.values import refuse, text

_MEMO_LIMIT = 1 << 16  # distinct (r, f, network) scores remembered at one max f


class LearnedEviction(EvictionPolicy):
    name = "learned"
    summary = "FlashMoE's learned eviction: a small network scores recency and frequency, evict the highest"
    source = "paper 003 (FlashMoE), section 3.2, Algorithm 1 and Table 1"

    def __init__(self, spec, seed=0, model_path=None, model: LearnedModel | None = None):
        super().__init__(spec, seed)
        if model is None:
            path = bundled.DEFAULT_LEARNED_MODEL if model_path is None else text(model_path, "learned.model_path")
            model = load_model(path)
        elif not isinstance(model, LearnedModel):
            refuse("learned.model", model, "must be a LearnedModel (give a file with learned.model_path)")
        self.model = model
        self._networks = self.model.networks
        if self.model.per_layer and self._networks != spec.num_layers:
            raise ConfigError(f"learned-eviction model {self.model.path}: its {self._networks} per-layer networks "
                              f"do not fit a model of {spec.num_layers} MoE layers")
        capacity = max(16, spec.num_layers * spec.num_experts)
        # Per slot (one per key ever seen); Python lists for the per-request work ...
        self._slot: dict = {}         # key -> slot
        self._keys: list = []         # slot -> key
        self._network: list = []      # slot -> the network that scores it (its MoE layer if per-layer)
        self._token: list = []        # token of the last routing, -1: never
        self._freq: list = []         # f
        self._clock: list = []        # clock of the last request (the tie-break), -1: never requested
        self._is_resident: list = []
        self._neg: list = []          # -score of a resident, as in its live heap entry
        # ... and NumPy copies for the batched rescoring.
        self._token_np = np.full(capacity, -1, dtype=np.int64)
        self._freq_np = np.zeros(capacity, dtype=np.int64)
        self._network_np = np.zeros(capacity, dtype=np.int64)
        self._resident = np.zeros(capacity, dtype=bool)
        self._max_freq = 0
        self._heap: list = []         # (-score, clock, slot); an entry is live while it matches the slot
        self._residents = 0
        self._dirty: set = set()      # resident slots requested or inserted since they were scored
        self._scored_token = None     # token and max f at which the residents were last all scored
        self._scored_max = -1
        self._memo: dict = {}         # (r, f) code -> score, valid for max f == _memo_max
        self._memo_max = -1

    # ---------------------------------------------------------------------------------------- hooks

    def _new_slot(self, key) -> int:
        slot = len(self._keys)
        if slot == self._token_np.shape[0]:
            self._token_np = np.concatenate([self._token_np, np.full(slot, -1, np.int64)])
            self._freq_np = np.concatenate([self._freq_np, np.zeros(slot, np.int64)])
            self._network_np = np.concatenate([self._network_np, np.zeros(slot, np.int64)])
            self._resident = np.concatenate([self._resident, np.zeros(slot, bool)])
        self._slot[key] = slot
        self._network_np[slot] = self.spec.layer_of(key) if self._networks > 1 else 0
        self._keys.append(key)
        self._network.append(self.spec.layer_of(key) if self._networks > 1 else 0)
        self._token.append(-1)
        self._freq.append(0)
        self._clock.append(-1)
        self._is_resident.append(False)
        self._neg.append(0.0)
        return slot

    def on_access(self, key, ctx):
        slot = self._slot.get(key)
        if slot is None:
            slot = self._new_slot(key)
        token = ctx.token
        self._clock[slot] = ctx.clock
        if self._token[slot] != token:  # several requests in one token are one routing
            self._token[slot] = token
            self._token_np[slot] = token
            freq = self._freq[slot] + 1
            self._freq[slot] = freq
            self._freq_np[slot] = freq
            if freq > self._max_freq:
                self._max_freq = freq
        if self._is_resident[slot]:
            self._dirty.add(slot)  # new features, or at least a new last request

    def on_insert(self, key, ctx):
        slot = self._slot.get(key)
        if slot is None:
            slot = self._new_slot(key)  # a prefetched expert never routed: 1/r = 0, f = 0
        self._is_resident[slot] = True
        self._resident[slot] = True
        self._residents += 1
        self._dirty.add(slot)

    def on_evict(self, key):
        slot = self._slot[key]
        self._is_resident[slot] = False
        self._resident[slot] = False
        self._residents -= 1
        self._dirty.discard(slot)

    def victim(self, ctx):
        token = ctx.token
        if token != self._scored_token or self._max_freq != self._scored_max:
            self._rescore_all(token)
        elif self._dirty:
            self._rescore_dirty(token)
        heap, neg, clock, resident = self._heap, self._neg, self._clock, self._is_resident
        pinned = ctx.pinned
        skipped = []
        found = None
        while heap:
            entry = heap[0]
            slot = entry[2]
            if not resident[slot] or entry[0] != neg[slot] or entry[1] != clock[slot]:
                heapq.heappop(heap)  # stale
            elif pinned and self._keys[slot] in pinned:
                skipped.append(heapq.heappop(heap))
            else:
                found = slot
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        if found is None:
            raise NoEvictableExpert
        return self._keys[found]

    def decision_flops(self, residents: int) -> float:
        """Algorithm 1 scores every cached expert with the network, then takes the highest (MaxDist): one row
        per resident through its network. (This implementation rescores lazily, so its own time per decision is
        often less; the runtime measures that time.)"""
        return float(residents * self.model.flops_per_row)

    # ------------------------------------------------------------------------------------- scoring

    def _evaluate(self, codes: list, max_freq: int) -> list:
        """Scores of codes ``(r * (max f + 1) + f) * networks + network``, from the memo or one batched
        forward pass."""
        memo = self._memo
        values = [memo.get(c) for c in codes] if memo else [None] * len(codes)
        missing = [i for i, value in enumerate(values) if value is None]
        if missing:
            new = np.array([codes[i] for i in missing], dtype=np.int64)
            rest, network = np.divmod(new, self._networks)
            recency, freq = np.divmod(rest, max_freq + 1)
            out = self.model.forward(features(recency, freq, max_freq), network).tolist()
            for i, value in zip(missing, out):
                values[i] = memo[codes[i]] = value
        return values

    def _rescore_all(self, token: int) -> None:
        """Score every resident at ``token`` (all recencies or max f moved) and rebuild the heap. The
        codes of (r = 1, f) and (r = 1, f + 1) for every known expert's f are scored in the same pass:
        experts requested later in this token will need them, so _rescore_dirty rarely runs the network."""
        max_freq = self._max_freq
        if max_freq != self._memo_max or len(self._memo) > _MEMO_LIMIT:
            self._memo.clear()
            self._memo_max = max_freq
        base, networks = max_freq + 1, self._networks
        slots = np.flatnonzero(self._resident)
        last = self._token_np[slots]
        recency = np.where(last >= 0, np.maximum(token - last + 1, 1), 0)  # 0: never routed
        codes = (recency * base + self._freq_np[slots]) * networks + self._network_np[slots]
        # the codes of r = 1 are base * networks + f * networks + network: a mask over them takes the residents'
        # and every known expert's (r = 1, f) and (r = 1, f + 1) in order, so that only the residents' codes
        # are sorted (the same sorted codes as one np.unique of them all, hence the same batches and scores)
        known = self._freq_np[:len(self._keys)]
        known_network = self._network_np[:len(self._keys)]
        first, stop = base * networks, 2 * base * networks
        recent = np.zeros(first, np.bool_)
        recent[known * networks + known_network] = True
        soon = known < max_freq
        recent[(known[soon] + 1) * networks + known_network[soon]] = True
        resident = np.unique(codes)
        recent[resident[(resident >= first) & (resident < stop)] - first] = True
        unique = np.concatenate([resident[resident < first], first + np.flatnonzero(recent),
                                 resident[resident >= stop]])
        values = np.asarray(self._evaluate(unique.tolist(), max_freq), dtype=np.float64)
        negs = (-values[np.searchsorted(unique, codes)]).tolist()
        slot_list = slots.tolist()
        neg, clock = self._neg, self._clock
        for slot, value in zip(slot_list, negs):
            neg[slot] = value
        heap = list(zip(negs, [clock[s] for s in slot_list], slot_list))
        heapq.heapify(heap)
        self._heap = heap
        self._scored_token, self._scored_max = token, max_freq
        self._dirty.clear()

    def _rescore_dirty(self, token: int) -> None:
        """Re-score and re-queue the residents requested or inserted since the last eviction (same token,
        same max f)."""
        base, networks = self._max_freq + 1, self._networks
        memo, last_token, freq, network = self._memo, self._token, self._freq, self._network
        pending = []
        scored = []
        for slot in self._dirty:
            last = last_token[slot]
            code = ((max(token - last + 1, 1) if last >= 0 else 0) * base + freq[slot]) * networks + network[slot]
            value = memo.get(code)
            if value is None:
                pending.append((slot, code))
            else:
                scored.append((slot, value))
        self._dirty.clear()
        if pending:
            values = self._evaluate([code for _, code in pending], self._max_freq)
            scored.extend((slot, value) for (slot, _), value in zip(pending, values))
        heap, neg, clock = self._heap, self._neg, self._clock
        for slot, value in scored:
            neg[slot] = -value
            heapq.heappush(heap, (-value, clock[slot], slot))
        if len(heap) > 2 * self._residents + 64:  # too many stale entries: keep the live ones
            resident = self._is_resident
            heap = [e for e in heap if resident[e[2]] and e[0] == neg[e[2]] and e[1] == clock[e[2]]]
            heapq.heapify(heap)
            self._heap = heap

    def scores(self, ctx) -> dict:
        """The current score of every resident expert (for reports and tests)."""
        self._rescore_all(ctx.token)
        return {self._keys[s]: -self._neg[s] for s in np.flatnonzero(self._resident).tolist()}
