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

The network is read on a grid. Its two inputs are functions of integers (r, f, max f), and a replay of a day
of traffic asks for tens of millions of scores: ranking every resident at every token costs, at the paper's
17k multiply-adds a row, about a hundred seconds of arithmetic on 38M requests (1,536 residents a token over
100k tokens), where every other policy's kernel takes a second or two. So the network is evaluated once, at
every point of a grid (learned_model.score_table, 263,425 rows, a third of a second), and a score is a table
lookup: recency exact up to r = 128 tokens (1/r as the paper's feature), beyond it in 128 bins of equal width
in 1/r (1/r then lies within 1/128 of 0, and a bin is 1/16384 wide); f / max f rounded to the nearest
multiple of 1/1024. A tie of grid points is an exact tie, broken like any other by the older last request.
Against the network on its exact inputs this moves the hit rate by at most 0.016 points on the bundled
OLMoE trace and the shared Qwen1.5-MoE and gpt-oss traces at 12.5, 25 and 50% of the experts, and by at most
0.001 on a synthetic trace of 7.7M requests (benchmarks/learned_grid.py, docs/policies/learned.md), and it lets
one compiled kernel make the Python policy's decisions exactly: both read the same table with the same integer
indices.

Speed: scores are kept for the resident experts and recomputed lazily, at the next eviction: all of them
when the token advanced or max f changed (every recency or every normalised frequency moved), otherwise only
those requested or inserted since the last eviction. The residents sit in a heap ordered by (-score, last
request), rebuilt at each full rescoring and updated lazily in between, so a victim costs O(log n). The
compiled kernel (replay_kernel) keeps them in slots under a winner tree instead, which a full rescoring
rebuilds bottom-up at a third of a heap's cost: 2.2 s for 38.4M requests at 1,536 experts, LRU's 0.24 s
(`benchmarks/report_scale.py --tokens 100000 --kernels`).
"""

from __future__ import annotations

import heapq

import numpy as np

from moe_offload import bundled
from moe_offload.errors import ConfigError
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert
from moe_offload.policies.learned_model import (GRID_COLUMNS, GRID_FAR, GRID_RECENCY, GRID_ROWS, LearnedModel,
                                                column_scale, grid_column, grid_columns, grid_row, grid_rows,
                                                load_model)
from moe_offload.values import refuse, text


class LearnedEviction(EvictionPolicy):
    name = "learned"
    summary = "FlashMoE's learned eviction: a small network scores recency and frequency, evict the highest"
    source = "paper 003 (FlashMoE), section 3.2, Algorithm 1 and Table 1"
    replay_cost = 10  # LRU replays a kernel run costs (base.py)

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
        self._table = self.model.score_table()  # [networks, GRID_ROWS, GRID_COLUMNS]
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
        per resident through its network. (This implementation reads the network's scores from its grid and
        rescores lazily, so its own time per decision is less; the runtime measures that time.)"""
        return float(residents * self.model.flops_per_row)

    def kernel_arguments(self) -> tuple[np.ndarray, np.ndarray]:
        """The score table, flattened (a copy: the shared table is read-only, the kernel's arguments are not),
        and the number of networks."""
        return self._table.reshape(-1).copy(), np.array([self._networks], np.int64)

    # ------------------------------------------------------------------------------------- scoring

    def _rescore_all(self, token: int) -> None:
        """Score every resident at ``token`` (all recencies or max f moved) and rebuild the heap."""
        slots = np.flatnonzero(self._resident)
        last = self._token_np[slots]
        recency = np.where(last >= 0, np.maximum(token - last + 1, 1), 0)  # 0: never routed
        values = self._table[self._network_np[slots], grid_rows(recency),
                             grid_columns(self._freq_np[slots], self._max_freq)]
        negs = (-values).tolist()
        slot_list = slots.tolist()
        neg, clock = self._neg, self._clock
        for slot, value in zip(slot_list, negs):
            neg[slot] = value
        heap = list(zip(negs, [clock[s] for s in slot_list], slot_list))
        heapq.heapify(heap)
        self._heap = heap
        self._scored_token, self._scored_max = token, self._max_freq
        self._dirty.clear()

    def _rescore_dirty(self, token: int) -> None:
        """Re-score and re-queue the residents requested or inserted since the last eviction (same token,
        same max f)."""
        table, scale = self._table, column_scale(self._max_freq)
        last_token, freq, network = self._token, self._freq, self._network
        heap, neg, clock = self._heap, self._neg, self._clock
        for slot in self._dirty:
            last = last_token[slot]
            row = grid_row(max(token - last + 1, 1)) if last >= 0 else 0
            value = -float(table[network[slot], row, grid_column(freq[slot], scale)])
            neg[slot] = value
            heapq.heappush(heap, (value, clock[slot], slot))
        self._dirty.clear()
        if len(heap) > 2 * self._residents + 64:  # too many stale entries: keep the live ones
            resident = self._is_resident
            heap = [e for e in heap if resident[e[2]] and e[0] == neg[e[2]] and e[1] == clock[e[2]]]
            heapq.heapify(heap)
            self._heap = heap

    def scores(self, ctx) -> dict:
        """The current score of every resident expert (for reports and tests)."""
        self._rescore_all(ctx.token)
        return {self._keys[s]: -self._neg[s] for s in np.flatnonzero(self._resident).tolist()}

    # ------------------------------------------------------------------------------ compiled replay

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them, on the same table (``floats``, flattened; ``ints``:
        the number of networks). The residents sit in slots, each slot with its expert's last token, f, network
        and score side by side, under a winner tree (the slot of the highest (score, -last request) of each
        subtree): when the token or max f moved, the first eviction rescores every slot in one sequential pass
        and rebuilds the tree bottom-up, which costs a third of rebuilding a heap of the same residents; a
        resident requested after that is re-scored and its path to the root recomputed (O(log n)). Rows are read
        from an array of ``grid_row`` (every recency past GRID_RECENCY * GRID_FAR shares the last bin's row)."""
        networks = ints[0]
        num_keys = num_layers * num_experts
        far = GRID_RECENCY * GRID_FAR
        rows = np.empty(far + 2, np.int64)
        for recency in range(far + 2):
            rows[recency] = grid_row(recency) * GRID_COLUMNS
        last = np.full(num_keys, -1, np.int64)  # token of the last routing, -1: never
        freq = np.zeros(num_keys, np.int64)
        slot_of = np.full(num_keys, -1, np.int64)  # -1: not resident
        leaves = capacity  # node n's children are 2n and 2n + 1, leaf s is node leaves + s: any count of leaves
        slot_key = np.zeros(leaves, np.int64)
        slot_last = np.zeros(leaves, np.int64)
        slot_freq = np.zeros(leaves, np.int64)
        slot_base = np.zeros(leaves, np.int64)  # the offset of the slot's network in the table
        score = np.full(leaves, -np.inf)  # an empty slot never wins
        stamp = np.zeros(leaves, np.int64)  # clock of the slot's last request
        stale = np.zeros(leaves, np.bool_)  # requested while the tree was not current (its stamp moved)
        stale_slots = np.zeros(leaves, np.int64)
        stale_count = 0
        winner = np.zeros(2 * leaves, np.int64)
        for slot in range(leaves):
            winner[leaves + slot] = slot
        size = 0
        max_freq = 0
        scale = 0.0
        scored_token = -1  # the slots' scores and the tree are those of (scored_token, scored_max)
        scored_max = -1
        for t in range(keys.shape[0]):
            key = keys[t]
            token = tokens[t]
            if last[key] != token:
                last[key] = token
                freq[key] += 1
                if freq[key] > max_freq:
                    max_freq = freq[key]
                    scale = column_scale(max_freq)
            current = token == scored_token and max_freq == scored_max
            slot = slot_of[key]
            if slot >= 0:
                key_hits[key] += 1
                slot_last[slot] = token
                slot_freq[slot] = freq[key]
                stamp[slot] = t
                if current:  # routed in this token: r = 1
                    score[slot] = floats[slot_base[slot] + rows[1] + grid_column(freq[key], scale)]
                    _tree_update(winner, score, stamp, leaves, slot, True)
                elif not stale[slot]:
                    stale[slot] = True
                    stale_slots[stale_count] = slot
                    stale_count += 1
                continue
            if size == capacity:
                if not current:
                    # every slot rescored; when only max f moved (same token, same rows), few columns change:
                    # then only the paths of the changed and the requested slots are recomputed
                    same_token = token == scored_token
                    for i in range(size):
                        recency = min(token - slot_last[i] + 1, far + 1)
                        value = floats[slot_base[i] + rows[recency] + grid_column(slot_freq[i], scale)]
                        if same_token and value != score[i] and not stale[i]:
                            stale[i] = True
                            stale_slots[stale_count] = i
                            stale_count += 1
                        score[i] = value
                    if same_token and stale_count * 16 < leaves:
                        for j in range(stale_count):  # whole paths: correct in any order (several changed)
                            _tree_update(winner, score, stamp, leaves, stale_slots[j], False)
                    else:
                        _tree_build(winner, score, stamp, leaves)
                    for j in range(stale_count):
                        stale[stale_slots[j]] = False
                    stale_count = 0
                    scored_token = token
                    scored_max = max_freq
                    current = True
                slot = winner[1]
                slot_of[slot_key[slot]] = -1
            else:
                slot = size
                size += 1
            slot_of[key] = slot
            slot_key[slot] = key
            slot_last[slot] = token
            slot_freq[slot] = freq[key]
            slot_base[slot] = (key // num_experts) * GRID_ROWS * GRID_COLUMNS if networks > 1 else 0
            stamp[slot] = t
            if current:  # else a placeholder: the rebuild rescores it
                score[slot] = floats[slot_base[slot] + rows[1] + grid_column(freq[key], scale)]
                _tree_update(winner, score, stamp, leaves, slot, True)


def _wins(score, stamp, a, b):
    """Whether slot ``a`` is evicted before slot ``b``: the higher score, then the older last request (bitwise
    operators, not ``and``/``or``: no branch to mispredict)."""
    return (score[a] > score[b]) | ((score[a] == score[b]) & (stamp[a] < stamp[b]))


def _tree_build(winner, score, stamp, leaves):
    """Every inner node of the winner tree over ``leaves`` slots (node n's children 2n, 2n + 1; leaf s at
    ``leaves + s``; node 1 is the winner of all), from the bottom up."""
    for node in range(leaves - 1, 0, -1):
        left = winner[2 * node]
        right = winner[2 * node + 1]
        winner[node] = right + _wins(score, stamp, left, right) * (left - right)


def _tree_update(winner, score, stamp, leaves, slot, alone):
    """The winners on the path from ``slot``'s leaf to the root, after its score or stamp changed. ``alone``:
    no other slot changed since the tree was right, so the path above a node whose winner neither was nor is
    ``slot`` is unchanged and is left; else the whole path is recomputed."""
    node = (leaves + slot) // 2
    while node >= 1:
        left = winner[2 * node]
        right = winner[2 * node + 1]
        before = winner[node]
        after = right + _wins(score, stamp, left, right) * (left - right)
        winner[node] = after
        if alone and before != slot and after != slot:
            break
        node //= 2
