"""MoEpic's split experts in the runtime (paper 004, sections 3.1-3.4): what `generate --split-config` runs.

The configuration is the one `moe-offload configure` writes and the timed simulator runs
(simulator/split.py: per layer i, C_i cached tops, the split ratio theta_i and the prefetch count Y_i). In the
runtime an expert is split along its intermediate dimension: its *top* is intermediate rows [0, r_i) (gate
rows, up rows and down columns [0, r_i)), r_i = round(theta_i I) of the I rows (at least one), its *bottom*
the rest. The fast tier of the data path (runtime/segment_tier.py) holds per layer a cache of C_i tops and one
buffer of K whole experts' bytes (the paper's U_b) in segment-sized ranges; what a split run and an unsplit
one are compared at is that memory. An expert whose top is cached loads only its bottom, else the whole
expert, whose top is then cached if the policy makes room. It computes its top part as soon as it has its
top and its bottom part when the bottom lands (models/experts.py adds them in a fixed order), so the top's
compute overlaps the bottom's transfer. A prefetcher (MoEpic's: Y_i from the configuration) fills free buffer
ranges ahead of the router; the online loop (split_online.py) reconfigures the tops every tau tokens.

A slot holds a part in the *segment layout*: gate rows, up rows (together ``gate_up_proj`` [2r, H]), then the
down columns as a row-major [H, r] block (``down_proj``); a whole copy in the buffer is [top | bottom] in that
layout. A whole expert is read with the checked chunk reads of the pack (runtime/storage.py) and rearranged; a
bottom alone is read as the manifest's byte ranges (``bottom_ranges``: ``H + 2`` ranges, fewer when they
touch) straight into the segment layout, and checked against an xxHash3 of the same bytes taken when the whole
expert was read and verified (the pack's checksums cover whole chunks; a top is cached only from a whole read,
so every bottom-only read has one before it).

Lossless: the parts are the same contiguous tensors as the all-resident reference's
(models/experts.py ``split_parts``) and are added in the same order, so a split run gives the tokens and
logits of the all-resident model computing with the same split, whatever the budget, policy or prefetcher
(with online reconfiguration: with the split in force in each pass, split_online.py). A host tier
(``host_budget``) holds whole experts as stored between the files and the fast tier. Preloading is not done
here; the engine refuses it with a split configuration.

Counters: an access is a *hit* when the expert's top is in fast memory when its layer is routed (cached, or in
a prefetched whole copy; its bottom is loaded unless theta is 1 or a prefetch brought it), a miss loads the
whole expert; either counts as a demand load when bytes move on demand. (The timed simulator's split hit is an
expert complete when routed.)
"""

from __future__ import annotations

import math
import time

from moe_offload.errors import ConfigError
from moe_offload.prefetch.budget import PrefetchBudget
from moe_offload.runtime.runner import ModelRunner, _wait
from moe_offload.simulator.split import SplitConfig, read_split_config


def split_rows(config: SplitConfig, intermediate: int, source: str) -> list[int]:
    """r_i = round(theta_i I) intermediate rows of each layer's top; a top of no row is refused."""
    rows = []
    for layer, plan in enumerate(config.layers):
        r = min(intermediate, round(plan.split_ratio * intermediate))
        if r < 1:
            raise ConfigError(f"{source}: layer {layer}: a top of {plan.split_ratio:g} x {intermediate} intermediate "
                              "rows holds no row")
        rows.append(r)
    return rows


def split_memory(config: SplitConfig, rows: list[int], intermediate: int, expert_bytes: int, top_k: int) -> int:
    """Bytes of the tops of ``config`` at ``rows`` of ``intermediate`` and of the buffer of K whole experts of
    ``expert_bytes`` (the fast tier's)."""
    return expert_bytes * (sum(p.cached_experts * r for p, r in zip(config.layers, rows)) + top_k * intermediate) \
        // intermediate


def load_split_config(split) -> tuple[SplitConfig, str]:
    """(configuration, its name for messages) from a SplitConfig or the path of `configure --json`'s file."""
    if isinstance(split, SplitConfig):
        return split, "the split configuration"
    return read_split_config(split), str(split)


def bottom_ranges(manifest, rows: int) -> tuple[list[tuple[int, int]], int]:
    """The byte ranges, in an expert's region, of its bottom below intermediate row ``rows`` (gate rows, up rows,
    each down row's columns; ranges that touch are merged), in the segment layout's order, and its size."""
    tensors = {t.name: t for t in manifest.tensors}
    gate_up, down = tensors["gate_up_proj"], tensors["down_proj"]
    H, I = down.shape
    item = gate_up.nbytes // (2 * I * H)
    b = I - rows
    runs = [(gate_up.offset + rows * H * item, b * H * item), (gate_up.offset + (I + rows) * H * item, b * H * item)]
    runs += [(down.offset + (h * I + rows) * item, b * item) for h in range(H)]
    merged = [runs[0]]
    for offset, nbytes in runs[1:]:
        last_offset, last_bytes = merged[-1]
        if last_offset + last_bytes == offset:
            merged[-1] = (last_offset, last_bytes + nbytes)
        else:
            merged.append((offset, nbytes))
    return merged, 3 * b * H * item


class SplitRunner(ModelRunner):
    """The model runner of a split run: its expert source yields each expert in parts (module doc)."""

    def __init__(self, model, adapter, spec, path, counters, *, online=None, **options):
        """``online``: MoEpic's online reconfiguration (runtime/split_online.py), or None."""
        super().__init__(model, adapter, spec, path, counters, **options)
        self.online = online
        if online is not None:  # its statistics read every pass's routing and speculative gate predictions
            self.needs_routing = self.needs_gate_prediction = True
        if self.prefetcher is not None and path.split.prefetches is not None:
            self.prefetcher.set_budget(self._budget(path.split.prefetches))

    def _budget(self, prefetches):
        """MoEpic's Y_i: the configuration's count alone without a profile (the runtime derives no link timings of
        its own), else with the online loop's profile."""
        if self.online is not None:
            return self.online.budget(prefetches)
        return PrefetchBudget(expert_load_seconds=math.nan, window_seconds=(math.nan,) * self.spec.num_layers,
                              prefetches=prefetches)

    def _pass_end(self, module, args, output):
        view, iteration = self.view, self.iteration
        super()._pass_end(module, args, output)
        if self.online is None or view is None:
            return
        config = self.online.after_pass(view, iteration)
        if config is None:
            return
        split = self.path.split
        with self.path.cond:
            tokens = self.online.configurator.statistics.tokens
            cached = self.online.configurator.ranked_tops(config)  # Algorithm 1: each layer's top-C_i by priority
            if split.reconfigure(config, iteration, tokens, cached) and self.prefetcher is not None:
                self.prefetcher.set_budget(self._budget(config.prefetches))

    def end_request(self, request: int) -> None:
        super().end_request(request)
        if self.online is not None:
            self.online.end_request(request)

    def layer_experts(self, layer: int, experts: list[int], tokens: list[list[int]]):
        J = self.spec.num_experts
        keys = [layer * J + e for e in experts]
        c, path, split = self.counters, self.path, self.path.split
        host = path.tiers[1].cache if len(path.tiers) > 1 else None
        own = [self.request_counters.get(request) for request in self.segment_requests]
        cond = path.cond
        with cond:
            path.raise_failure()
            ctx = path.ctx
            ctx.layer, ctx.iteration, ctx.token = layer, self.iteration, self.iteration
            ctx.request = self.segment_requests[0]
            if self.policy_needs_probs:
                ctx.probs = self.probs
                ctx.predicted = (None if self.prefetcher is None else self.matcher.predicted
                                 if self.matcher is not None else self.prefetcher.predicted_map())
            path.pinned.clear()
            path.pinned.update(keys)
            path.layer_routed(layer, keys)
            first_round = self.first_round[layer] if self.policy_needs_rounds else None
            for expert, key, counts in zip(experts, keys, tokens):
                ctx.clock += 1
                if first_round is not None:  # the replay's round of its first request in the pass (runner.py)
                    ctx.round = self.rounds + first_round[expert]
                ctx.routed = {request: n for request, n in zip(self.segment_requests, counts) if n}
                c.accesses += 1
                c.per_layer_accesses[layer] += 1
                used = path.use(key)
                hit = split.tops[layer].touch(key, ctx) or split.landed.get(key, False)
                c.hits += hit
                c.per_layer_hits[layer] += hit
                # a segment landed or on the last wire needs no demand load
                demand = split.needs_bytes(key) and key not in split.landed and not path.on_wire_to_fast(key)
                from_host = demand and host is not None and key in host
                if demand:
                    path.route(key, demand=True, priority=math.inf)
                c.on_demand_loads += demand
                c.host_hits += from_host
                for counters, n in zip(own, counts):
                    if counters is not None and n:
                        counters.count_access(layer, hit, demand, used, from_host)
                for request in ctx.routed:
                    self.keys_of.setdefault(request, set()).add(key)
            ctx.routed = None
            cond.notify_all()
        try:
            remaining = [(key, part) for key in keys for part in range(split.parts(key))]
            while remaining:
                with cond:
                    waited = time.perf_counter()
                    ready = cond.wait_for(lambda: path.raise_failure() or next(
                        (item for item in remaining if split.has_part(*item)), None))
                    stalled = time.perf_counter() - waited
                    for counters in (c, *own):  # every request of the pass waits for the layer
                        if counters is not None:
                            counters.stalled(layer, stalled)
                    tensors, event = split.part_tensors(*ready)
                remaining.remove(ready)
                _wait(event)
                key = ready[0]
                yield key - layer * J, tensors
                if not any(k == key for k, _ in remaining):
                    with cond:  # computed: its buffer slot is free, its top may be evicted
                        split.consume(key)
                        path.pinned.discard(key)
        finally:
            with cond:
                for key in keys:
                    for worker in path.workers:
                        worker.queue.withdraw(key)
                    path.forward.pop(key, None)
                    split.consume(key)
                path.pinned.difference_update(keys)
                cond.notify_all()

