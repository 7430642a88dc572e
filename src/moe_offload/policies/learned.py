"""FlashMoE's learned eviction (paper 003, section 3.2, Algorithm 1, Table 1).

Every cached expert is described by its recency r (time steps since it was last routed, r = 1 when it
was routed in the current step; a time step is one token, ``ctx.token``) and its frequency f (tokens in
which it was routed so far, kept across evictions). The network sees [1/r, f / max f], max f being the
largest frequency of any expert so far, and predicts a "routing distance"; on a miss with a full cache
the resident expert with the HIGHEST predicted distance is evicted (the paper's ``cache.MaxDist``).
Equal scores (equal inputs) are broken by the older last request (LRU). The network (3 linear layers,
hidden 128, SiLU) is trained by moe_offload.training.learned_eviction to reproduce Belady's choices;
inference here is NumPy only.

The shipped model, src/moe_offload/data/learned-eviction.npz, was made with (rows 150:299 held out):

    PYTHONPATH=src python3 -m moe_offload.cli.main train-eviction \\
        src/moe_offload/data/olmoe-1b-7b-decode299.parquet --rows 0:150 \\
        --cache-sizes 64 128 256 512 --epochs 200 --seed 0 -o src/moe_offload/data/learned-eviction.npz

Speed: scores are kept for the resident experts and recomputed lazily, at the next eviction: all of them
in one batched forward pass when the token advanced or max f changed (every recency or every
normalised frequency moved), otherwise only those routed or inserted since the last eviction. The
network is evaluated once per distinct (r, f) pair (a memo valid while max f stays the same), which
also makes equal inputs get bit-identical scores.
"""

from __future__ import annotations

import numpy as np

from moe_offload import bundled
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert
from moe_offload.policies.learned_model import LearnedModel, features, load_model

_MEMO_LIMIT = 1 << 16  # distinct (r, f) scores remembered at one max f


class LearnedEviction(EvictionPolicy):
    name = "learned"
    summary = "FlashMoE's learned eviction: a small network scores recency and frequency, evict the highest"
    source = "paper 003 (FlashMoE), section 3.2, Algorithm 1 and Table 1"

    def __init__(self, spec, seed=0, model_path=None, model: LearnedModel | None = None):
        super().__init__(spec, seed)
        self.model = model if model is not None else load_model(model_path or bundled.DEFAULT_LEARNED_MODEL)
        capacity = max(16, spec.num_layers * spec.num_experts)
        self._slot: dict = {}         # key -> slot
        self._keys: list = []         # slot -> key
        self._token: list = []        # slot -> token of the last routing (-1: never), read per access
        self._freq: list = []         # slot -> f
        self._clock: list = []        # slot -> clock of the last request (tie-break)
        self._is_resident: list = []  # slot -> bool
        self._token_np = np.full(capacity, -1, dtype=np.int64)  # the same, for the batched rescoring
        self._freq_np = np.zeros(capacity, dtype=np.int64)
        self._resident = np.zeros(capacity, dtype=bool)
        self._score = np.full(capacity, -np.inf, dtype=np.float32)  # -inf where not resident
        self._max_freq = 0
        self._dirty: set = set()      # resident slots whose features changed since they were scored
        self._scored_token = None     # token and max f at which the resident scores were computed
        self._scored_max = -1
        self._memo: dict = {}         # (r, f) code -> score, valid for max f == _memo_max
        self._memo_max = -1

    # ---------------------------------------------------------------------------------------- hooks

    def _new_slot(self, key) -> int:
        slot = len(self._keys)
        if slot == self._score.shape[0]:
            grow = slot
            self._token_np = np.concatenate([self._token_np, np.full(grow, -1, np.int64)])
            self._freq_np = np.concatenate([self._freq_np, np.zeros(grow, np.int64)])
            self._resident = np.concatenate([self._resident, np.zeros(grow, bool)])
            self._score = np.concatenate([self._score, np.full(grow, -np.inf, np.float32)])
        self._slot[key] = slot
        self._keys.append(key)
        self._token.append(-1)
        self._freq.append(0)
        self._clock.append(-1)
        self._is_resident.append(False)
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
                self._dirty.add(slot)

    def on_insert(self, key, ctx):
        slot = self._slot.get(key)
        if slot is None:
            slot = self._new_slot(key)  # a prefetched expert never routed: r = infinity, f = 0
        self._is_resident[slot] = True
        self._resident[slot] = True
        self._dirty.add(slot)

    def on_evict(self, key):
        slot = self._slot[key]
        self._is_resident[slot] = False
        self._resident[slot] = False
        self._score[slot] = -np.inf
        self._dirty.discard(slot)

    def victim(self, ctx):
        token = ctx.token
        if token != self._scored_token or self._max_freq != self._scored_max:
            self._rescore(np.flatnonzero(self._resident), token)
            self._scored_token, self._scored_max = token, self._max_freq
            self._dirty.clear()
        elif self._dirty:
            self._rescore(np.fromiter(self._dirty, dtype=np.int64, count=len(self._dirty)), token)
            self._dirty.clear()
        scores = self._score
        if ctx.pinned:
            scores = scores.copy()
            for key in ctx.pinned:
                slot = self._slot.get(key)
                if slot is not None:
                    scores[slot] = -np.inf
        best = int(scores.argmax())
        top = scores[best]
        if top == -np.inf:
            raise NoEvictableExpert
        ties = np.flatnonzero(scores == top)
        if ties.size > 1:
            best = min(ties.tolist(), key=self._clock.__getitem__)
        return self._keys[best]

    # ------------------------------------------------------------------------------------- scoring

    def _rescore(self, slots: np.ndarray, token: int) -> None:
        """Recompute the scores of ``slots`` at ``token``: one forward pass over the (r, f) pairs not
        yet in the memo."""
        if slots.size == 0:
            return
        max_freq = self._max_freq
        memo = self._memo
        if max_freq != self._memo_max or len(memo) > _MEMO_LIMIT:
            memo.clear()
            self._memo_max = max_freq
        last = self._token_np[slots]
        recency = np.where(last >= 0, np.maximum(token - last + 1, 1), 0)  # 0: never routed
        code = recency * (max_freq + 1) + self._freq_np[slots]
        unique, inverse = np.unique(code, return_inverse=True)
        codes = unique.tolist()
        values = [memo.get(c) for c in codes]
        missing = [i for i, value in enumerate(values) if value is None]
        if missing:
            new = unique[missing]
            out = self.model.forward(features(new // (max_freq + 1), new % (max_freq + 1), max_freq)).tolist()
            for i, value in zip(missing, out):
                values[i] = memo[codes[i]] = value
        self._score[slots] = np.asarray(values, dtype=np.float32)[inverse.reshape(-1)]

    def scores(self, ctx) -> dict:
        """The current score of every resident expert (for reports and tests)."""
        resident = np.flatnonzero(self._resident)
        self._rescore(resident, ctx.token)
        self._scored_token, self._scored_max = ctx.token, self._max_freq
        self._dirty.clear()
        return {self._keys[s]: float(self._score[s]) for s in resident.tolist()}
