"""MoE-Infinity's activation-aware cache replacement (paper 002, Algorithm 2).

EAMs (section 4.2). The Expert Activation Matrix of a sequence counts, per layer l and expert j, the
sequence's tokens routed to j: ``M[l][j]``, with ``sum_j M[l][j]`` = its tokens so far. An access carries its
tokens by request (``ctx.routed``; the replay's None is one token of ``ctx.request``), so a prefill or a
batched iteration counts every token of every sequence, and rows of several requests interleaved in a trace
each go to their own sequence's EAM. A sequence's EAM starts empty with its first token (Algorithm 1,
step 2: NEW EAM at the start of an inference) and ends when the driver reports that its request has run its
last iteration (``on_request_end``), so the memory held is that of the running sequences only.

Which EAM ranks a victim. Algorithm 2 ranks by ``cur_eam``, the EAM that Algorithm 1's INFERENCE builds
over its token buffer b: when b holds a batch, ``cur_eam[l][e] += t.size()`` counts the tokens of all the
batch's sequences. Sequences join and leave a batch (continuous batching, a recorded batch whose prompts
finish at different times), so here the current EAM is the sum of the EAMs of the sequences running now
(started, not ended): ``eam="running"``, the default. Paper 002 does not say how a batch's sequences share
the cache; the other reading, that the replacement serves one sequence and ranks by that sequence's own EAM
(section 4.2 keeps one EAM per sequence), is ``eam="request"``: the EAM of ``ctx.request``, the sequence of
the token being served (in a batched access the iteration's first request, policies/base.py). A resident
expert e of layer l has priority

    p = (EAM[l][e] / sum(EAM[l]) + EPSILON) * (1 - l / L)

(steps 6-8; a layer the EAM has not reached has ratio 0) and the lowest p is replaced. Ties go to the
expert whose count changed least recently (``running``) or that was used least recently (``request``).

Tiers. Algorithm 2 runs "when there is a need to fetch an expert into a memory device, be it GPU HBM or
Host Memory" (section 6.1), with the same current EAM. The instances of one run (``run_factory``: one per
tier) therefore share one ``SequenceEAMs``: the host tier ranks with the EAMs of every access although the
simulator shows it only the GPU's misses. Each access is counted once, by the first tier that sees it: the
tiers of a run are shown one access with the same ``ctx.clock`` and key.

The initial fill (section 6.1): "the GPU cache is initialized with experts with topological order where
experts are filled into GPU layer by layer". With ``fill="layers"`` the cache starts full of the first
experts in that order, layer 0's, then layer 1's, ... (``placement``, which the replay and the timed
simulator load before the first access; the runtime's ``preload`` fills its fast tier in the same key
order); the default ``fill="empty"`` starts empty, as the other policies do.

Why ``running`` is not a scan of the cache: within one layer the order is the order of the counts (the row
sum and the layer decay are common to the layer), so each instance keeps its resident experts of each layer
ranked by count, updated in O(log n) when a count changes, and a miss compares the L layer minima (each
cached until its layer changes). When a sequence ends, the layers its EAM reached are re-ranked.
``request`` ranks by a different EAM at every access, so its ``victim`` scans the residents.
"""

from __future__ import annotations

from moe_offload.errors import ConfigError
from moe_offload.policies._ranked import RankedKeys
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert

EPSILON = 1e-6
RANKINGS = ("running", "request")
FILLS = ("empty", "layers")


class SequenceEAMs:
    """The EAMs of the sequences running in one run, and their sum, shared by the run's MoE-Infinity
    instances (one per tier); see the module docstring."""

    def __init__(self, num_layers: int, num_experts: int):
        self.num_layers, self.num_experts = num_layers, num_experts
        self.by_request: dict = {}  # request -> its EAM, [L][J] token counts
        self.running = [[0] * num_experts for _ in range(num_layers)]  # sum over by_request
        self.running_row_sum = [0] * num_layers
        self._rankers: list = []  # instances ranking by ``running``, told of every change
        self._last_clock = self._last_key = None  # the access counted last

    def eam(self, request) -> list:
        """The EAM of ``request`` so far (``[L][J]`` counts; zeros when it is not running)."""
        eam = self.by_request.get(request)
        return eam if eam is not None else [[0] * self.num_experts for _ in range(self.num_layers)]

    def count(self, key, ctx) -> None:
        """The access of ``key`` described by ``ctx``: each request's EAM gains its tokens (once per access)."""
        if ctx.clock == self._last_clock and key == self._last_key:  # another tier already counted this access
            return
        self._last_clock, self._last_key = ctx.clock, key
        layer, expert = divmod(key, self.num_experts)
        routed = ctx.routed
        if routed is None:  # one token of ctx.request (the replay)
            eam = self.by_request.get(ctx.request)
            if eam is None:
                eam = self.by_request[ctx.request] = [[0] * self.num_experts for _ in range(self.num_layers)]
            eam[layer][expert] += 1
            tokens = 1
        else:
            tokens = 0
            for request, routed_tokens in routed.items():
                eam = self.by_request.get(request)
                if eam is None:
                    eam = self.by_request[request] = [[0] * self.num_experts for _ in range(self.num_layers)]
                eam[layer][expert] += routed_tokens
                tokens += routed_tokens
        row = self.running[layer]
        row[expert] += tokens
        self.running_row_sum[layer] += tokens
        for ranker in self._rankers:
            ranker._count_changed(key, layer, row[expert])

    def end(self, request) -> None:
        """``request`` has run its last iteration: its EAM leaves the running sum and is forgotten."""
        eam = self.by_request.pop(request, None)
        if eam is None:
            return
        layers = []
        for layer, row in enumerate(eam):
            tokens = sum(row)
            if tokens:
                running = self.running[layer]
                for expert, count in enumerate(row):
                    running[expert] -= count
                self.running_row_sum[layer] -= tokens
                layers.append(layer)
        for ranker in self._rankers:
            ranker._rerank(layers)


class MoEInfinity(EvictionPolicy):
    name = "moe-infinity"
    summary = ("activation-aware: evict the lowest (EAM ratio + eps) * (1 - layer/L), EAM of the running "
               "sequences")
    source = "paper 002, Algorithm 2"

    def __init__(self, spec, seed=0, eam: str = "running", shared: SequenceEAMs | None = None, fill: str = "empty"):
        super().__init__(spec, seed)
        if eam not in RANKINGS:
            raise ConfigError(f"{self.name}: eam must be one of {', '.join(RANKINGS)}, not {eam!r}")
        if fill not in FILLS:
            raise ConfigError(f"{self.name}: fill must be one of {', '.join(FILLS)}, not {fill!r}")
        self.fill = fill
        L, J = spec.num_layers, spec.num_experts
        if shared is None:
            shared = SequenceEAMs(L, J)
        elif not isinstance(shared, SequenceEAMs) or (shared.num_layers, shared.num_experts) != (L, J):
            raise ConfigError(f"{self.name}: shared must be the SequenceEAMs of a {L} x {J} model, "
                              f"not {shared!r}")
        self.sequences = shared
        self.ranking = eam
        if eam == "running":
            self._by_layer = [RankedKeys() for _ in range(L)]  # resident experts of a layer, ranked by count
            self._layer_min: list = [None] * L  # (p, key) of each layer's best victim; None = recompute
            shared._rankers.append(self)
        else:
            self._recency: dict = {}  # resident keys, least recently used first

    @classmethod
    def run_factory(cls, spec, seed=0, **options):
        shared = SequenceEAMs(spec.num_layers, spec.num_experts)
        return lambda: cls(spec, seed=seed, shared=shared, **options)

    def placement(self, slots, trace):
        """The initial fill (module doc): the first ``slots`` keys, layer by layer, with ``fill="layers"``."""
        if self.fill == "empty":
            return []
        return list(range(min(slots, self.spec.num_layers * self.spec.num_experts)))

    def priority(self, key, eam=None) -> float:
        """Algorithm 2, steps 6-8, for one expert, with ``eam`` (``[L][J]`` counts; default the running sum)."""
        L, J = self.spec.num_layers, self.spec.num_experts
        layer, expert = divmod(key, J)
        if eam is None:
            count, total = self.sequences.running[layer][expert], self.sequences.running_row_sum[layer]
        else:
            count, total = eam[layer][expert], sum(eam[layer])
        ratio = count / total if total else 0.0
        return (ratio + EPSILON) * (1.0 - layer / L)

    # ------------------------------------------------------------------------------------------ hooks

    def on_access(self, key, ctx):
        self.sequences.count(key, ctx)
        if self.ranking == "request" and key in self._recency:
            self._recency[key] = self._recency.pop(key)

    def on_insert(self, key, ctx):
        if self.ranking == "request":
            self._recency[key] = None
            return
        layer, expert = divmod(key, self.spec.num_experts)
        self._by_layer[layer].set(key, self.sequences.running[layer][expert])
        self._layer_min[layer] = None

    def on_evict(self, key):
        if self.ranking == "request":
            self._recency.pop(key, None)
            return
        layer = key // self.spec.num_experts
        self._by_layer[layer].discard(key)
        self._layer_min[layer] = None

    def on_request_end(self, request):
        self.sequences.end(request)

    def victim(self, ctx):
        if self.ranking == "request":
            return self._victim_of(self.sequences.eam(ctx.request), ctx.pinned)
        pinned = ctx.pinned
        best = None
        for layer, ranked in enumerate(self._by_layer):
            candidate = None if pinned else self._layer_min[layer]
            if candidate is None:
                lowest = ranked.lowest(pinned)
                if lowest is None:
                    continue
                candidate = (self.priority(lowest[1]), lowest[1])
                if not pinned:
                    self._layer_min[layer] = candidate
            if best is None or candidate[0] < best[0]:
                best = candidate
        if best is None:
            raise NoEvictableExpert
        return best[1]

    # ------------------------------------------------------------------------------------------ internals

    def _count_changed(self, key, layer, count) -> None:
        """The running count of ``key`` (layer ``layer``) is now ``count`` and its layer's row sum changed."""
        self._layer_min[layer] = None
        ranked = self._by_layer[layer]
        if key in ranked:
            ranked.set(key, count)

    def _rerank(self, layers) -> None:
        """The running counts of ``layers`` dropped (a sequence ended)."""
        running, J = self.sequences.running, self.spec.num_experts
        for layer in layers:
            row = running[layer]
            self._by_layer[layer].rescore_all(lambda key: row[key % J])
            self._layer_min[layer] = None

    def _victim_of(self, eam, pinned):
        """``eam="request"``: the lowest priority under ``eam`` among the unpinned residents, least recently
        used first on ties."""
        J, L = self.spec.num_experts, self.spec.num_layers
        totals = [sum(row) for row in eam]
        best, best_p = None, None
        for key in self._recency:
            if key in pinned:
                continue
            layer, expert = divmod(key, J)
            total = totals[layer]
            p = ((eam[layer][expert] / total if total else 0.0) + EPSILON) * (1.0 - layer / L)
            if best is None or p < best_p:
                best, best_p = key, p
        if best is None:
            raise NoEvictableExpert
        return best
