"""vLLM: whole expert tensors read from host memory in every forward pass (UVA), or copied whole a few layers
ahead (the prefetch backend), or the per-expert LFRU cache of its PR #37190.

``--cpu-offload-gb G --cpu-offload-params experts`` (vllm-project/vllm vllm/model_executor/offloader/uva.py,
``UVAOffloader``; built with ``cpu_offload_max_bytes = int(G * 1024**3)``, offloader/__init__.py). What it
offloads, in order: the decoder layers are wrapped one after another from the first, and within a layer its
parameters in registration order; a parameter is offloaded when its name has ``experts`` as a whole segment
(``mlp.experts.w13_weight``, ``mlp.experts.w2_weight``) and the bytes offloaded so far are below the budget, so
the last one offloaded may overshoot it. A FusedMoE layer registers ``w13_weight`` (gate and up of all its
experts, two thirds of their bytes) before ``w2_weight`` (down, one third). So G offloads a prefix of the
sequence w13(0), w2(0), w13(1), w2(1), ...: the first layers' experts entirely, and possibly the gate and up
of the next layer's experts with its down kept in VRAM. ``offloaded_prefix`` finds the shortest prefix that
leaves the rest in the budget, and ``gib_for`` the G that offloads exactly it (a G printed rounded up
would offload one tensor more).

Nothing offloaded is ever kept in VRAM. With UVA (the default where the platform has it) the offloaded tensors
are views of pinned host memory: the MoE kernel reads the experts it is routed to over the link, in every
pass, once each. Without UVA (``VLLM_WEIGHT_OFFLOADING_DISABLE_UVA``) the wrapped layer's whole state is copied
to the GPU before each forward: every offloaded byte crosses in every pass; the setting is timed with UVA.

It is timed as split experts (simulator/split.py, the mechanism of MoEpic's split ones), preloaded: a layer
with nothing offloaded caches the tops of all J experts at theta = 1 (whole experts, resident from the start),
the layer whose gate and up are offloaded the tops of all J at the down projection's third, and a layer
offloaded whole no top. An expert's offloaded part then crosses the host link into the buffer each time a
pass routes it and leaves once it has run, never kept: the bytes UVA reads. What this leaves out: UVA's
kernel reads while it computes, where the simulator computes an expert's offloaded share once it has landed
(its resident top before, as split experts do), and the buffer of K experts serializes a prefill's many
experts that UVA would read at the link's rate all the same. Pinned host memory holds the offloaded tensors
(and the experts PR #37190 copies from), so the experts must fit in the host tier
(``PlacementContext.outside_host_memory``).

Where every expert fits, the release needs no flag: that setting is listed first (every expert resident).

``--offload-group-size G --offload-num-in-group n --offload-prefetch-step s --offload-params experts`` (the
prefetch backend, which ``--offload-backend auto`` chooses when G > 0: vllm/model_executor/offloader/prefetch.py,
``PrefetchOffloader``). The decoder layer i is offloaded when ``i % G >= G - n`` (the last n of each group of
G); its experts live in pinned host memory and every pass copies all of them, whatever it routes, into one of s
static GPU buffers, s offloaded layers ahead, the compute waiting for a layer's copy before the layer (its
attention included): the timed simulator's streamed layers (simulator/timed/layerwise.py) beside the static
placement of the other layers (``static-layers``). VRAM then holds L - M layers' experts and s buffers of one
layer's (M offloaded layers), so a budget of B experts needs M >= L + s - B // J. ``offload_groups`` chooses the
(G, n) that offloads the fewest layers that fit, spread most evenly (the widest smallest gap between two
offloaded layers, counted round the pass), since a copy overlaps the layers computed while it runs; settings
with s = 1 and s = 2 are listed. The layer index is the decoder layer's: a model with dense layers before its
MoE ones (DeepSeek-V3's first three) counts them too, and its groups fall elsewhere than on the trace's MoE
layers' numbering, which this takes for the model's.

``--moe-expert-cache-size N`` (PR #37190, open, not merged; ``CachedWeightProvider``): every layer keeps
a GPU cache of N experts, a miss is copied from pinned host memory on demand (synchronously, in
``prepare()``), and the victim is chosen by LFRU: ``lfru-dist`` (policies/lfru.py, the rule derived there).
"""

from __future__ import annotations

import math

import numpy as np

from moe_offload.engines.base import EngineModel, PlacementContext, Setting, layer_keys
from moe_offload.simulator.split import LayerSplitPlan, SplitConfig

GIB = 1024**3


def expert_tensors(num_layers: int, num_experts: int, expert_bytes: int) -> list[tuple[int, str, int]]:
    """(layer, name, bytes) of the expert tensors in the order vLLM offloads them: w13 (gate and up, two
    thirds of each expert) then w2 (down), layer by layer."""
    w13 = 2 * num_experts * expert_bytes // 3
    return [item for layer in range(num_layers)
            for item in ((layer, "w13_weight", w13), (layer, "w2_weight", num_experts * expert_bytes - w13))]


def offloaded_prefix(num_layers: int, num_experts: int, expert_bytes: int, room_experts: int) -> int:
    """How many tensors of ``expert_tensors`` must be offloaded for the rest to fit in ``room_experts``."""
    tensors = expert_tensors(num_layers, num_experts, expert_bytes)
    excess = (num_layers * num_experts - room_experts) * expert_bytes
    total = 0
    for count, (_, _, nbytes) in enumerate(tensors):
        if total >= excess:
            return count
        total += nbytes
    return len(tensors)


def gib_for(tensors: list[tuple[int, str, int]], count: int) -> str:
    """The ``--cpu-offload-gb`` value that offloads exactly the first ``count`` tensors: the shortest decimal G
    with sum(first count - 1) < int(G * 2^30) <= sum(first count)."""
    sums = np.cumsum([0] + [nbytes for _, _, nbytes in tensors])
    low, high = int(sums[count - 1]), int(sums[count])
    for digits in range(1, 16):
        value = math.floor(high / GIB * 10**digits) / 10**digits
        if low < int(value * GIB) <= high:
            return f"{value:.{digits}f}"
    raise ValueError("no decimal offloads exactly these tensors")  # unreachable: at 15 digits value * 2^30 == high


def offloaded_by(gib: float, tensors: list[tuple[int, str, int]]) -> int:
    """How many tensors UVAOffloader offloads with ``--cpu-offload-gb gib`` (uva.py: it offloads a tensor while
    the bytes so far are below the budget)."""
    budget, total, count = int(gib * GIB), 0, 0
    for _, _, nbytes in tensors:
        if total >= budget:
            break
        total += nbytes
        count += 1
    return count


def streamed_share(tensors: list[tuple[int, str, int]], count: int, num_experts: int,
                   expert_bytes: int) -> dict[int, float]:
    """Per layer with an offloaded tensor among the first ``count``, the share of each of its experts' bytes
    that is offloaded (1 when both of its tensors are)."""
    offloaded: dict[int, int] = {}
    for layer, _, nbytes in tensors[:count]:
        offloaded[layer] = offloaded.get(layer, 0) + nbytes
    return {layer: nbytes / (num_experts * expert_bytes) for layer, nbytes in offloaded.items()}


def uva_split(streamed: dict[int, float], num_layers: int, num_experts: int) -> SplitConfig:
    """The split experts that time ``--cpu-offload-gb`` (module doc): per layer, every top at the share of an
    expert that stays in VRAM, none where nothing stays."""
    plans = []
    for layer in range(num_layers):
        kept = 1.0 - streamed.get(layer, 0.0)
        plans.append(LayerSplitPlan(num_experts, kept) if kept > 0 else LayerSplitPlan(0, 1.0))
    return SplitConfig(tuple(plans), preloaded=True)


def offloaded_layers(num_layers: int, group_size: int, num_in_group: int) -> list[int]:
    """The layers the prefetch backend offloads: the last ``num_in_group`` of each group of ``group_size``."""
    return [layer for layer in range(num_layers) if layer % group_size >= group_size - num_in_group]


def offload_groups(num_layers: int, least: int) -> tuple[int, int] | None:
    """The (G, n) that offloads the fewest layers, at least ``least``, spread most evenly (the widest smallest
    gap between consecutive offloaded layers, round the pass; then the smaller G); None if ``least`` exceeds
    the layers."""
    best, best_key = None, None
    for group_size in range(1, num_layers + 1):
        for num_in_group in range(1, group_size + 1):
            layers = offloaded_layers(num_layers, group_size, num_in_group)
            if len(layers) < least:
                continue
            gaps = [b - a for a, b in zip(layers, layers[1:] + [layers[0] + num_layers])]
            key = (len(layers), -min(gaps), group_size)
            if best_key is None or key < best_key:
                best, best_key = (group_size, num_in_group), key
    return best


def prefetch_settings(context: PlacementContext) -> list[Setting]:
    """The prefetch backend's settings at the budget, one per prefetch step (1, 2) that fits (module doc)."""
    spec = context.spec
    L, J = spec.num_layers, spec.num_experts
    out = []
    if context.slots >= L * J or not context.expert_bytes:
        return out
    for step in (1, 2):
        chosen = offload_groups(L, max(step, L + step - context.slots // J))
        room = context.slots - step * J  # beside the buffers: the VRAM layers' experts (at least), the rest idle
        if chosen is None or room < 1:
            continue
        group_size, num_in_group = chosen
        streamed = offloaded_layers(L, group_size, num_in_group)
        out.append(Setting(
            "vllm", f"--offload-group-size {group_size} --offload-num-in-group {num_in_group} "
                    f"--offload-prefetch-step {step} ({len(streamed)} layers streamed, {step} ahead)",
            ["--offload-group-size", str(group_size), "--offload-num-in-group", str(num_in_group),
             "--offload-prefetch-step", str(step), "--offload-params", "experts"],
            "static-layers", {"cpu_layers": streamed}, layer_keys([l for l in range(L) if l not in streamed], J),
            cache_slots=room,
            layerwise={"layers": streamed, "prefetch_step": step, "before_attention": True,
                       "source": "vLLM's prefetch offloader (prefetch.py)"},
            cannot_host=context.outside_host_memory("the offloaded layers' experts are copied from pinned host "
                                                    "memory"),
            note=f"{len(streamed)} layers' experts copied whole in every pass, {step} offloaded layer(s) ahead, "
                 f"into {step} GPU buffer(s) of a layer; the compute waits for a layer's copy before its attention"))
    return out


def settings(context: PlacementContext) -> list[Setting]:
    spec = context.spec
    L, J = spec.num_layers, spec.num_experts
    out = []
    if context.slots >= L * J:  # nothing to offload: the release's default
        out.append(Setting("vllm", "every expert in VRAM (no offload flag)", [], "static-layers", {"cpu_layers": []},
                           layer_keys(range(L), J)))
    if context.slots < L * J and context.expert_bytes:
        tensors = expert_tensors(L, J, context.expert_bytes)
        count = offloaded_prefix(L, J, context.expert_bytes, context.slots)
        gib = gib_for(tensors, count)
        streamed = streamed_share(tensors, count, J, context.expert_bytes)
        layers = count // 2
        parts = ([f"the first {layers} layers' experts" if layers > 1 else "layer 0's experts"] if layers else []) \
            + ([f"gate and up of layer {layers}"] if count % 2 else [])
        out.append(Setting("vllm", f"--cpu-offload-gb {gib} ({', '.join(parts)})",
                           ["--cpu-offload-gb", gib, "--cpu-offload-params", "experts"], "lru",
                           resident=layer_keys([l for l in range(L) if l not in streamed], J),
                           split=uva_split(streamed, L, J),
                           cannot_host=context.outside_host_memory("UVA reads the offloaded experts from pinned "
                                                                   "host memory"),
                           note="the offloaded experts read over the link in every pass that routes them, never "
                                "kept (UVA): split experts, preloaded"))
    out += prefetch_settings(context)
    per_layer = context.slots // L
    if per_layer >= 1:
        out.append(Setting("vllm", f"--moe-expert-cache-size {per_layer} (PR #37190)",
                           ["--moe-expert-cache-size", str(per_layer)], "lfru-dist",
                           cannot_host=context.outside_host_memory("PR #37190 copies its misses from pinned host "
                                                                   "memory"),
                           note="vllm-project/vllm PR #37190 (open, not merged): LFRU cache of "
                                f"{per_layer} experts per layer, misses copied on demand"))
    return out


ENGINE = EngineModel(
    name="vllm", command="vllm serve MODEL",
    source="vllm-project/vllm vllm/model_executor/offloader/uva.py (--cpu-offload-gb, --cpu-offload-params), "
           "prefetch.py (--offload-group-size, --offload-num-in-group, --offload-prefetch-step); PR #37190 "
           "(--moe-expert-cache-size, LFRU)",
    settings=settings,
    limits="released vLLM offloads whole expert tensors (of the first layers, read over the link in every pass "
           "that routes them; or of every G-th layers, copied whole in every pass a few layers ahead) and keeps "
           "none of them; a per-expert cache exists only in the open PR #37190")
