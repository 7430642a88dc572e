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
compute overlaps the bottom's transfer: the model runner (runtime/runner.py) hands each part over as it is in
fast memory (``SplitExperts`` below says what it does differently from a whole-expert run). A prefetcher
(MoEpic's: Y_i from the configuration) fills free buffer ranges ahead of the router; the online loop
(split_online.py) reconfigures the tops every tau tokens.

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

import dataclasses

from moe_offload.errors import ConfigError
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
    config, source = ((split, "the split configuration") if isinstance(split, SplitConfig)
                      else (read_split_config(split), str(split)))
    empty = next((layer for layer, plan in enumerate(config.layers) if plan.cached_experts == 0), None)
    if empty is not None or config.preloaded:
        raise ConfigError(f"{source}: " + (f"layer {empty} caches no top segment" if empty is not None
                                           else "its tops are loaded before the first pass")
                          + ": the runtime splits experts as MoEpic does, each layer caching the tops of the "
                            "experts it uses (the timed simulator runs such a configuration: vLLM's offload)")
    return config, source


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


class SplitExperts:
    """What the model runner (runtime/runner.py) does differently when the fast tier holds segments: an expert
    is in fast memory in parts (its top, its bottom; module doc), a hit is its top there, and MoEpic's online
    loop may reconfigure the tier between two passes. The runner's other fast tier is runtime/tiers.py
    ``WholeExperts``."""

    def __init__(self, path, prefetcher, link_budget, online=None):
        """``link_budget``: what the link into the fast tier carries per layer (prefetch/budget.py); ``online``:
        MoEpic's online reconfiguration (runtime/split_online.py), or None."""
        self.path, self.tier, self.prefetcher, self.online = path, path.split, prefetcher, online
        self.spec, self.link_budget = path.spec, link_budget
        self._give_budget(self.tier.prefetches)

    def _give_budget(self, prefetches) -> None:
        """The prefetcher's budget: the link's, with MoEpic's Y_i of the configuration in force when it gives
        them (else the loads that fit each layer's window), as the timed simulator gives it."""
        if self.prefetcher is not None:
            self.prefetcher.set_budget(dataclasses.replace(self.link_budget, prefetches=prefetches))

    # ---------------------------------------------------------------------- one access and its parts (locked)
    def access(self, key: int, ctx) -> tuple[bool, bool]:
        """(hit: its top is in fast memory, cached or in a landed whole copy; whether bytes of it must still move
        in: its bottom, or the whole expert)."""
        split = self.tier
        hit = split.tops[key // self.spec.num_experts].touch(key, ctx) or split.landed.get(key, False)
        return hit, split.needs_bytes(key) and key not in split.landed

    def admits(self, key: int, ctx) -> bool:
        """A split run computes every expert in fast memory: a miss is always loaded."""
        return True

    def parts(self, key: int) -> int:
        return self.tier.parts(key)

    def has_part(self, key: int, part: int) -> bool:
        return self.tier.has_part(key, part)

    def part_tensors(self, key: int, part: int):
        return self.tier.part_tensors(key, part)

    def computed(self, key: int) -> None:
        """Every part of ``key`` computed: its buffer range is free, its top may be evicted."""
        self.tier.consume(key)
        self.path.pinned.discard(key)

    def release(self, keys) -> None:
        """The layer is over (or gave up): what is still queued for it is withdrawn, its buffer ranges freed."""
        path = self.path
        for key in keys:
            for worker in path.workers:
                worker.queue.withdraw(key)
            path.forward.pop(key, None)
            self.tier.consume(key)
        path.pinned.difference_update(keys)

    # ------------------------------------------------------------------------------ between passes
    def after_pass(self, view, iteration: int) -> None:
        """The pass ``view`` is over: the online loop's new configuration, if any, is applied (Algorithm 1)."""
        config = self.online.after_pass(view, iteration)
        if config is None:
            return
        with self.path.cond:
            configurator = self.online.configurator
            cached = configurator.ranked_tops(config)  # Algorithm 1: each layer's top-C_i by priority
            if self.tier.reconfigure(config, iteration, configurator.statistics.tokens, cached):
                self._give_budget(config.prefetches)
