"""MoEpic's split experts in the GPU (paper 004, sections 3.1-3.4): what the timed simulator runs for a
configuration of `moe-offload configure`.

Layer i caches the *top segments*, theta_i of an expert's bytes each, of up to C_i experts, in a cache of
its own (C_i top segments, V_i = theta_i C_i experts' worth of VRAM) managed by the run's eviction policy.
The rest of an expert, its *bottom segment*, is fetched when needed into the prefetch buffer: only the
bottom segment when the top is cached, else the whole expert (paper 004 prefetches "the bottom segments (or
full-size experts) of the next layer's predicted experts into VRAM's buffer", section 3.1). A whole expert
takes a whole expert's bytes of the buffer from the start of its transfer until it has run; when it lands its
top segment is copied into the layer's cache if the policy makes room for it ("once the cache miss, MoEpic
evicts the lowest-priority expert from VRAM, and replaces it with the newly loaded expert", section 3.3),
never evicting a top that the current layer computes with or whose expert is buffered. A buffered segment is
consumed once its expert has run, and dropped when its layer is routed without it: the buffer serves the
layer it was fetched for (a whole copy landing after its layer passed without it caches no top). The runtime
does the same (runtime/segment_tier.py); the paper says only that a missed expert's top replaces the
lowest-priority one, not when: both cache it as it lands, so that a prefetched expert's top is there for the
next token. The copy from the buffer into the cache takes no time here (it stays inside the GPU), and no
transfer waits for the evictions it makes (timed/decisions.py times the evictions that make room for a transfer).

A layer may cache no top (C_i = 0): every expert it runs then comes whole through the buffer and leaves it
once it has run. A configuration may also be *preloaded*: each layer's cache then holds the tops of its experts
0..C_i-1 from the start. Both together describe vLLM's ``--cpu-offload-gb`` (engines/vllm.py): layers whose
experts stay in VRAM cache all J tops at theta = 1, a layer whose gate and up are offloaded all J tops at the
down projection's share, and a layer offloaded whole none; what is offloaded crosses the link in every pass
that routes it and is never kept, as UVA reads it.

The buffer is the paper's U_b, "the size of K complete experts" (section 4.1), one for the whole model as
in equation 8's VRAM constraint U_n + sum V_i + U_b <= V, not one per layer: the segments of the layer
being computed and the prefetches for the next one share it. A prefetch waits while it has no room; a
demand load that finds no room drops landed segments of experts the current layer does not need (the
speculation for the layers ahead), the most recent first. The memory a split run reports is the top
segments plus this buffer, so that a split run and an unsplit one compare at the same VRAM.

An expert is *complete* (``key in experts``) when its top is cached and its bottom buffered, or its whole
copy buffered; it has its *top* when the top is cached or the whole copy buffered. The timed simulator
runs theta_i of an expert's compute as soon as it has its top, and the rest once it is complete, so the
top's compute overlaps the bottom's transfer (section 3.2).

Online reconfiguration (Algorithm 1, lines 8-10): ``reconfigure`` applies a new configuration to the
running caches between two passes, with nothing on its way in. The paper "ranks all N experts by their
cache priorities, and vertically splits the top-C_i experts" (section 3.4): each layer's cache holds exactly
the tops of its C_i given experts (simulator/timed/reconfigure.py ranks them) at the new ratio, the others
evicted, holds released; buffered bottom segments whose top is gone, or of a layer whose ratio changed, no
longer fit a top and are dropped. A new top lacks theta_new of an expert, a kept one (theta_new -
theta_old) when the ratio grows: ``reconfigure`` returns those transfers and bytes, which the simulator
loads before the next pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_offload.errors import ConfigError
from moe_offload.inputs import parse_json, read_text
from moe_offload.policies.base import AccessContext
from moe_offload.simulator.cache import ExpertCache, predicted_no_later_than
from moe_offload.values import format_bytes, integer, number


@dataclass(frozen=True)
class LayerSplitPlan:
    cached_experts: int          # C_i: experts whose top segment layer i caches (0: none, every expert whole)
    split_ratio: float           # theta_i: the top segment's share of an expert's bytes, in (0, 1]
    prefetches: int | None = None  # Y_i: experts the configurator expects the prefetch to reach (eq 11)

    def __post_init__(self):
        object.__setattr__(self, "cached_experts", integer(self.cached_experts, "cache_size", low=0))
        object.__setattr__(self, "split_ratio", number(self.split_ratio, "split_ratio", low=0, high=1,
                                                       low_open=True))
        if self.prefetches is not None:
            object.__setattr__(self, "prefetches", integer(self.prefetches, "prefetches", low=0))


@dataclass(frozen=True)
class SplitConfig:
    """Per layer, the experts whose top segment is cached, the split ratio and the prefetch count
    (configure --json's ``layers[i].cache_size``, ``layers[i].split_ratio`` and ``layers[i].prefetches``)."""

    layers: tuple[LayerSplitPlan, ...]
    preloaded: bool = False  # each layer's cache holds the tops of its experts 0..C_i-1 from the start

    @classmethod
    def of(cls, layers) -> "SplitConfig":
        """From the configurator's per-layer answers (``LayerSplit``: cache_size, split_ratio, prefetches)."""
        return cls(tuple(LayerSplitPlan(split.cache_size, split.split_ratio, split.prefetches) for split in layers))

    @classmethod
    def uniform(cls, budget_experts: float, num_layers: int, num_experts: int) -> "SplitConfig":
        """Algorithm 1's start (line 4): V_e / L experts' worth per layer and theta = 0.5, so C = V / 0.5 (at most
        the layer's N experts, theta = V / C then)."""
        share = budget_experts / num_layers
        cached = min(num_experts, max(1, round(share / 0.5)))
        return cls((LayerSplitPlan(cached, min(1.0, share / cached)),) * num_layers)

    @property
    def prefetches(self) -> tuple[int, ...] | None:
        """Y of every layer, or None when the configuration does not give them all."""
        counts = tuple(plan.prefetches for plan in self.layers)
        return None if None in counts else counts

    def top_bytes(self, layer: int, expert_bytes: int) -> int:
        return round(self.layers[layer].split_ratio * expert_bytes)

    def cache_bytes(self, expert_bytes: int) -> int:
        """Bytes of all layers' top-segment caches."""
        return sum(plan.cached_experts * self.top_bytes(layer, expert_bytes) for layer, plan in enumerate(self.layers))

    @staticmethod
    def buffer_bytes(top_k: int, expert_bytes: int) -> int:
        """The prefetch buffer U_b: K complete experts (module doc)."""
        return top_k * expert_bytes

    def memory_bytes(self, top_k: int, expert_bytes: int) -> int:
        """The VRAM of the split experts: the top segments and the buffer. A preloaded configuration stands for
        reads in place (vLLM's UVA, module doc): its buffer is the link's reads, no VRAM of the engine's."""
        return self.cache_bytes(expert_bytes) + (0 if self.preloaded else self.buffer_bytes(top_k, expert_bytes))

    def check(self, num_layers: int, num_experts: int, top_k: int, expert_bytes: int, gpu_name: str,
              gpu_bytes: int, source: str = "the split configuration") -> None:
        """Raise ConfigError, naming ``source``, unless the model and the GPU can run this configuration."""
        self.check_model(num_layers, num_experts, expert_bytes, source)
        buffer = self.buffer_bytes(top_k, expert_bytes)
        needed = self.memory_bytes(top_k, expert_bytes)
        if needed > gpu_bytes:
            with_buffer = "" if self.preloaded else f" and the buffer of {top_k} experts ({format_bytes(buffer)})"
            raise ConfigError(f"{source}: the cached top segments ({format_bytes(self.cache_bytes(expert_bytes))})"
                              f"{with_buffer} need {format_bytes(needed)}, more than the {format_bytes(gpu_bytes)} "
                              f"of the {gpu_name}")

    def check_model(self, num_layers: int, num_experts: int, expert_bytes: int,
                    source: str = "the split configuration") -> None:
        """Raise ConfigError, naming ``source``, unless the model has this configuration's layers and experts
        (the memory is checked by ``check``, or by the runtime for its own rounding: runtime/split.py)."""
        if len(self.layers) != num_layers:
            raise ConfigError(f"{source}: {len(self.layers)} layers, but the trace's model has {num_layers}")
        for layer, plan in enumerate(self.layers):
            if not 0 <= plan.cached_experts <= num_experts:
                raise ConfigError(f"{source}: layer {layer}: {plan.cached_experts} cached experts, not in "
                                  f"[0, {num_experts}]")
            if self.top_bytes(layer, expert_bytes) < 1:
                raise ConfigError(f"{source}: layer {layer}: a top segment of {plan.split_ratio:g} x "
                                  f"{expert_bytes} bytes holds no byte")
            if plan.prefetches is not None and not 0 <= plan.prefetches <= num_experts:
                raise ConfigError(f"{source}: layer {layer}: {plan.prefetches} prefetches, not in [0, {num_experts}]")


def read_split_config(path) -> SplitConfig:
    """The configuration in a file written by `moe-offload configure --json`; every value is checked here,
    naming the file and the layer."""
    what = "split configuration"
    document = parse_json(read_text(path, what), path, what)
    layers = document.get("layers") if isinstance(document, dict) else None
    if not isinstance(layers, list) or not layers:
        raise ConfigError(f"{path}: no list of layers; write it with `moe-offload configure --json`")
    plans = []
    for layer, entry in enumerate(layers):
        if not isinstance(entry, dict) or "cache_size" not in entry or "split_ratio" not in entry:
            raise ConfigError(f"{path}: layer {layer}: needs an integer cache_size and a number split_ratio")
        try:
            plans.append(LayerSplitPlan(entry["cache_size"], entry["split_ratio"], entry.get("prefetches")))
        except ConfigError as error:
            raise ConfigError(f"{path}: layer {layer}: {error}") from None
    return SplitConfig(tuple(plans))


class SegmentBuffer:
    """One layer's prefetch buffer: bytes reserved when a transfer starts, resident when it lands."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.reserved: dict[int, int] = {}  # key -> bytes on their way in
        self.resident: dict[int, int] = {}  # key -> bytes landed
        self.used = 0

    def has_room(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.capacity

    def reserve(self, key: int, nbytes: int) -> None:
        self.reserved[key] = nbytes
        self.used += nbytes

    def complete(self, key: int) -> None:
        self.resident[key] = self.reserved.pop(key)

    def release(self, key: int) -> None:
        self.used -= self.resident.pop(key)

    def room_from_landed(self, nbytes: int, keep) -> list[int]:
        """The landed segments, most recent first and none in ``keep``, whose release would make room for
        ``nbytes``; empty when no release is needed or none would be enough."""
        need = self.used + nbytes - self.capacity
        chosen = []
        for key in reversed([key for key in self.resident if key not in keep]):
            if need <= 0:
                break
            chosen.append(key)
            need -= self.resident[key]
        return chosen if need <= 0 else []


class SplitExperts:
    """The GPU tier of a split run: per-layer top-segment caches and the prefetch buffer (see the module doc).

    It answers the timed simulator as an ExpertCache does (``in``, ``touch``, ``reserve``, ``complete``),
    with sizes in bytes on the wire: ``transfer_bytes`` says what a transfer of ``key`` carries now."""

    def __init__(self, config: SplitConfig, num_experts: int, top_k: int, expert_bytes: int, make_policy):
        self.J, self.E = num_experts, expert_bytes
        self.top_bytes = [config.top_bytes(layer, expert_bytes) for layer in range(len(config.layers))]
        self.ratio = [plan.split_ratio for plan in config.layers]
        self.tops = [ExpertCache(plan.cached_experts * top, make_policy())
                     for plan, top in zip(config.layers, self.top_bytes)]
        self.buffer = SegmentBuffer(config.buffer_bytes(top_k, expert_bytes))
        self.whole: set[int] = set()  # keys whose buffered copy is the whole expert (its top was not cached)
        self._preload = [plan.cached_experts if config.preloaded else 0 for plan in config.layers]

    def preload(self, ctx: AccessContext) -> None:
        """A preloaded configuration's tops, before the first pass (module doc)."""
        for layer, count in enumerate(self._preload):
            for key in range(layer * self.J, layer * self.J + count):
                self.tops[layer].reserve(key, ctx, self.top_bytes[layer])
                self.tops[layer].complete(key, ctx)

    def _bottom_bytes(self, layer: int) -> int:
        return self.E - self.top_bytes[layer]

    @property
    def evictions(self) -> int:
        """Tops evicted, over all layers (each one a decision of the layer's policy)."""
        return sum(top.evictions for top in self.tops)

    def has_top(self, key: int) -> bool:
        return key in self.tops[key // self.J] or (key in self.whole and key in self.buffer.resident)

    def __contains__(self, key: int) -> bool:
        if key in self.buffer.resident:
            return True
        layer = key // self.J
        return key in self.tops[layer] and self._bottom_bytes(layer) == 0

    def touch(self, key: int, ctx: AccessContext) -> bool:
        self.tops[key // self.J].touch(key, ctx)
        return key in self

    @property
    def held(self) -> dict:
        """Prefetched top segments not used yet, over all layers (cache.py's hold rule)."""
        return {key: None for top in self.tops for key in top.held}

    def release(self, key: int) -> None:
        self.tops[key // self.J].release(key)

    def end_request(self, request) -> None:
        for top in self.tops:
            top.end_request(request)

    def transfer_bytes(self, key: int) -> int:
        """The bottom segment when the top is cached, else the whole expert."""
        layer = key // self.J
        return self._bottom_bytes(layer) if key in self.tops[layer] else self.E

    def _buffer_room(self, nbytes: int, ctx: AccessContext) -> bool:
        """Whether the buffer can take ``nbytes`` now; a demand load (not ``ctx.prefetch``) drops landed
        segments of experts the current layer does not need (not pinned), the most recent first."""
        buffer = self.buffer
        if buffer.has_room(nbytes):
            return True
        if ctx.prefetch:
            return False
        dropped = buffer.room_from_landed(nbytes, ctx.pinned)
        for key in dropped:
            self.consume(key)
        return bool(dropped)

    def reserve(self, key: int, ctx: AccessContext, nbytes: int, protect=()) -> bool:
        """Make room in the buffer for a transfer of ``nbytes`` (``transfer_bytes(key)``): the bottom segment when
        the top is cached, else the whole expert, whose top is offered to the cache when it lands (``complete``).
        False, with nothing changed, when the buffer has no room. ``protect``, what a prefetch into a cache of
        whole experts spares, has no use here: making room in the buffer evicts no top."""
        if not self._buffer_room(nbytes, ctx):
            return False
        self.buffer.reserve(key, nbytes)
        if key not in self.tops[key // self.J]:
            self.whole.add(key)
        return True

    def complete(self, key: int, ctx: AccessContext, layer_now: int = -1, predicted=()) -> None:
        """``key``'s segment has landed in the buffer. A whole copy's top is offered to its layer's cache unless
        its layer was routed without it (``layer_now``: the layer routed last; the copy then leaves the buffer,
        tiers.py), never evicting a top that the current layer computes with (``ctx.pinned``) or whose expert is
        buffered; the top of a prefetch not needed yet is held, and spares the residents predicted
        (``predicted``) for layers no later than its own (simulator/cache.py)."""
        self.buffer.complete(key)
        layer = key // self.J
        top = self.tops[layer]
        if key not in self.whole or key in top or not top.capacity or (layer <= layer_now and key not in ctx.pinned):
            return
        held = ctx.prefetch and key not in ctx.pinned
        protect = predicted_no_later_than(predicted, key, layer_now, self.J, len(self.tops)) \
            if held and predicted else ()
        pinned, prefetch = ctx.pinned, ctx.prefetch
        ctx.pinned, ctx.prefetch = pinned | self.buffer.reserved.keys() | self.buffer.resident.keys(), held
        try:
            if top.reserve(key, ctx, self.top_bytes[layer], protect):
                top.complete(key, ctx)
        finally:
            ctx.pinned, ctx.prefetch = pinned, prefetch

    def consume(self, key: int) -> None:
        """``key`` has run (or its layer passed without it): its buffered segment leaves the buffer."""
        if key in self.buffer.resident:
            self.buffer.release(key)
            self.whole.discard(key)

    def drop_unneeded(self, layer: int, needed: set) -> None:
        """Layer ``layer`` is routed: landed segments of its experts that it does not need leave the buffer."""
        J = self.J
        for key in [key for key in self.buffer.resident if key // J == layer and key not in needed]:
            self.consume(key)

    def reconfigure(self, config: SplitConfig, ctx: AccessContext, cached: list[list[int]]) -> tuple[int, int]:
        """Apply ``config`` between two passes, with no transfer into the GPU on its way, layer i caching the tops
        of the experts ``cached[i]`` (module doc). Returns (tops to load, their bytes): the new tops whole, the
        kept ones what they lack under a grown ratio."""
        if self.buffer.reserved or any(top.reserved for top in self.tops):
            raise RuntimeError("reconfiguring split experts while a segment is on its way in")
        transfers = nbytes = 0
        for layer, (plan, keys) in enumerate(zip(config.layers, cached)):
            old, new = self.top_bytes[layer], config.top_bytes(layer, self.E)
            top = self.tops[layer]
            for key in list(top.held):
                top.release(key)
            kept = len(set(keys) & top.resident.keys())
            missing = top.keep_exactly(keys, plan.cached_experts * new, ctx, entry_size=new)
            for key in missing:
                top.complete(key, ctx)
            for key in [key for key in self.buffer.resident if key // self.J == layer and key not in self.whole
                        and (new != old or key not in top)]:
                self.consume(key)  # a bottom cut at the old ratio, or of a top gone, completes no top
            self.top_bytes[layer], self.ratio[layer] = new, plan.split_ratio
            grown = kept if new > old else 0
            transfers += len(missing) + grown
            nbytes += len(missing) * new + grown * (new - old)
        return transfers, nbytes
