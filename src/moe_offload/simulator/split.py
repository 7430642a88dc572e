"""MoEpic's split experts in the GPU (paper 004, sections 3.1-3.4): what the timed simulator runs for a
configuration of `moe-offload configure`.

Layer i caches the *top segments*, theta_i of an expert's bytes each, of up to C_i experts, in a cache of
its own (C_i top segments, V_i = theta_i C_i experts' worth of VRAM) managed by the run's eviction policy.
The rest of an expert, its *bottom segment*, is fetched when needed into the layer's buffer of K complete
experts (the paper's U_b; K = top-k): only the bottom segment when the top is cached, else the whole
expert, whose top segment is then cached if the policy makes room for it (else the whole copy waits in
the buffer). A buffered segment is consumed once its expert has run, and dropped when its layer is
routed without it: the buffer serves the layer it was fetched for.

An expert is *complete* (``key in experts``) when its top is cached and its bottom buffered, or its whole
copy buffered; it has its *top* when the top is cached or the whole copy buffered. The timed simulator
runs theta_i of an expert's compute as soon as it has its top, and the rest once it is complete, so the
top's compute overlaps the bottom's transfer (section 3.2).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_offload.errors import ConfigError
from moe_offload.inputs import parse_json, read_text
from moe_offload.hardware.profile import format_bytes
from moe_offload.policies.base import AccessContext
from moe_offload.simulator.cache import ExpertCache
from moe_offload.values import integer, number


@dataclass(frozen=True)
class LayerSplitPlan:
    cached_experts: int   # C_i: experts whose top segment layer i caches
    split_ratio: float    # theta_i: the top segment's share of an expert's bytes, in (0, 1]

    def __post_init__(self):
        object.__setattr__(self, "cached_experts", integer(self.cached_experts, "cache_size", low=1))
        object.__setattr__(self, "split_ratio", number(self.split_ratio, "split_ratio", low=0, high=1,
                                                       low_open=True))


@dataclass(frozen=True)
class SplitConfig:
    """Per layer, the experts whose top segment is cached and the split ratio (configure --json's
    ``layers[i].cache_size`` and ``layers[i].split_ratio``)."""

    layers: tuple[LayerSplitPlan, ...]

    def top_bytes(self, layer: int, expert_bytes: int) -> int:
        return round(self.layers[layer].split_ratio * expert_bytes)

    def cache_bytes(self, expert_bytes: int) -> int:
        """Bytes of all layers' top-segment caches."""
        return sum(plan.cached_experts * self.top_bytes(layer, expert_bytes) for layer, plan in enumerate(self.layers))

    def check(self, num_layers: int, num_experts: int, top_k: int, expert_bytes: int, gpu_name: str,
              gpu_bytes: int, source: str = "the split configuration") -> None:
        """Raise ConfigError, naming ``source``, unless the model and the GPU can run this configuration."""
        if len(self.layers) != num_layers:
            raise ConfigError(f"{source}: {len(self.layers)} layers, but the trace's model has {num_layers}")
        for layer, plan in enumerate(self.layers):
            if not 1 <= plan.cached_experts <= num_experts:
                raise ConfigError(f"{source}: layer {layer}: {plan.cached_experts} cached experts, not in "
                                  f"[1, {num_experts}]")
            if self.top_bytes(layer, expert_bytes) < 1:
                raise ConfigError(f"{source}: layer {layer}: a top segment of {plan.split_ratio:g} x "
                                  f"{expert_bytes} bytes holds no byte")
        buffers = num_layers * top_k * expert_bytes
        needed = self.cache_bytes(expert_bytes) + buffers
        if needed > gpu_bytes:
            raise ConfigError(f"{source}: the cached top segments ({format_bytes(self.cache_bytes(expert_bytes))}) "
                              f"and the buffers of {top_k} experts per layer ({format_bytes(buffers)}) need "
                              f"{format_bytes(needed)}, more than the {format_bytes(gpu_bytes)} of the {gpu_name}")


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
            plans.append(LayerSplitPlan(entry["cache_size"], entry["split_ratio"]))
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


class SplitExperts:
    """The GPU tier of a split run: per-layer top-segment caches and segment buffers (see the module doc).

    It answers the timed simulator as an ExpertCache does (``in``, ``touch``, ``reserve``, ``complete``),
    with sizes in bytes on the wire: ``transfer_bytes`` says what a transfer of ``key`` carries now."""

    def __init__(self, config: SplitConfig, num_experts: int, top_k: int, expert_bytes: int, make_policy):
        self.J, self.E = num_experts, expert_bytes
        self.top_bytes = [config.top_bytes(layer, expert_bytes) for layer in range(len(config.layers))]
        self.ratio = [plan.split_ratio for plan in config.layers]
        self.tops = [ExpertCache(plan.cached_experts * top, make_policy())
                     for plan, top in zip(config.layers, self.top_bytes)]
        self.buffers = [SegmentBuffer(top_k * expert_bytes) for _ in config.layers]
        self.whole: set[int] = set()  # keys whose buffered copy is the whole expert (its top was not cached)

    def _bottom_bytes(self, layer: int) -> int:
        return self.E - self.top_bytes[layer]

    def has_top(self, key: int) -> bool:
        layer = key // self.J
        return key in self.tops[layer] or (key in self.whole and key in self.buffers[layer].resident)

    def __contains__(self, key: int) -> bool:
        layer = key // self.J
        if key in self.buffers[layer].resident:
            return True
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

    def reserve(self, key: int, ctx: AccessContext, nbytes: int, protect=()) -> bool:
        """Make room for a transfer of ``nbytes`` (``transfer_bytes(key)``): a bottom segment in the buffer, or a
        whole expert's top in the cache (tops of pinned or buffered experts are never evicted) and its bottom in
        the buffer, or, when the cache cannot make room, the whole expert in the buffer. False, with nothing
        changed, when the buffer has no room."""
        layer = key // self.J
        buffer, bottom = self.buffers[layer], self._bottom_bytes(layer)
        if nbytes == bottom:
            if not buffer.has_room(bottom):
                return False
            buffer.reserve(key, bottom)
            return True
        if not buffer.has_room(bottom):
            return False
        pinned = ctx.pinned
        ctx.pinned = pinned | buffer.reserved.keys() | buffer.resident.keys()
        try:
            admitted = self.tops[layer].reserve(key, ctx, self.top_bytes[layer], protect)
        finally:
            ctx.pinned = pinned
        if admitted:
            if bottom:
                buffer.reserve(key, bottom)
            return True
        if not buffer.has_room(self.E):
            return False
        buffer.reserve(key, self.E)
        self.whole.add(key)
        return True

    def complete(self, key: int, ctx: AccessContext) -> None:
        layer = key // self.J
        top, buffer = self.tops[layer], self.buffers[layer]
        if key in top.reserved:
            top.complete(key, ctx)
        if key in buffer.reserved:
            buffer.complete(key)

    def consume(self, key: int) -> None:
        """``key`` has run (or its layer passed without it): its buffered segment leaves the buffer."""
        buffer = self.buffers[key // self.J]
        if key in buffer.resident:
            buffer.release(key)
            self.whole.discard(key)

    def drop_unneeded(self, layer: int, needed: set) -> None:
        """Layer ``layer`` is routed: landed segments of experts it does not need leave the buffer."""
        for key in [key for key in self.buffers[layer].resident if key not in needed]:
            self.consume(key)
