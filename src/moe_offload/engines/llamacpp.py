"""llama.cpp and ik_llama.cpp: which layers' experts stay in host memory, computed there by the CPU.

What the engines express (ggml-org/llama.cpp common/arg.cpp and common/common.h; ik_llama.cpp takes the same
``-ot``, ``--cpu-moe`` and ``--n-cpu-moe``). A layer's routed experts are three stacked tensors,
``blk.N.ffn_{gate,up,down}_exps.weight`` (``ffn_gate_up_exps`` where gate and up are fused), so the unit of
placement is a layer: its experts are all in VRAM or all in host memory, where the CPU computes them.

* ``--cpu-moe``: every layer's experts on the CPU (the override ``LLM_FFN_EXPS_REGEX`` =
  ``\\.ffn_(up|down|gate|gate_up)_(ch|)exps`` to the CPU buffer type).
* ``--n-cpu-moe N``: for i = 0 .. N-1, one override ``llm_ffn_exps_block_regex(i)`` = ``blk\\.i`` +
  LLM_FFN_EXPS_REGEX to the CPU: the experts of the *first* N layers stay on the CPU.
* ``-ot REGEX=CPU`` (``--override-tensor``): every tensor whose name the regex finds (``std::regex_search``)
  goes to the CPU buffer: any set of layers, written here as one ``blk\\.(a|b|...)\\.ffn_...`` pattern.

With room for C experts of J per layer, F = floor(C / J) layers fit, so at least N = L - F layers stay on the
host. Which N is the question ik_llama.cpp's PR #672 asked: llama.cpp's flag always takes the first ones.

Why the best set of N layers is found exactly without trying all C(L, N). Nothing is loaded after the start in
a static placement, so nothing moves over the link, and the timed simulator's layers share only the clock: a
layer's time in a pass is its attention, its router, then the GPU's experts and the host's in parallel (the
hidden states over, the bypassed experts on the CPU, the results back), and the pass waits for both
(simulator/timed/run.py, Host compute). So the time of a pass is a sum over its layers of a term that depends
only on where that layer's experts are, and TTFT and TPOT, means of sums of passes, are additive too:

    T(host set H) = T(every layer on the host) - sum_{l not in H} g_l,   g_l = T(all host) - T(all host but l)

The best H of size N keeps on the GPU the F layers of largest gain g_l (TPOT's; where TPOT's tie, as at
batch-1 decoding, which routes K experts in every layer, TTFT's decide). The L + 1 runs that measure the gains
(on the profile, never on the scored traffic) give the optimum of all C(L, N) sets; the tests check the identity
on random sets and against an exhaustive search.

The GPU LRU cache of host-resident experts of llama.cpp PR #27861 (ggml-org/llama.cpp pull request 27861, open;
its src/llama-moecache.cpp), ``--cpu-moe --moe-expert-cache S``: every layer's experts on the host, and per
layer S slots of VRAM that hold recently used experts (S + 1 experts of VRAM per layer: its slot S is
permanently zero), ``--moe-expert-cache-inserts`` uploads per layer per step (default 2). It is run as the PR
defines it (simulator/timed/uploads.py): ``lru-dist`` on S slots per layer, every miss computed on the host,
up to 2 of a pass's misses per layer uploaded after it, most recent first, published at the first step after
they land, and passes of more than one token (prefill, batches) computed on the host without the cache.

The PR caches the layers that live on the host whichever flag put them there (``-ot``, ``--n-cpu-moe``), so
it combines with layers kept in VRAM: ``--n-cpu-moe N --moe-expert-cache S`` keeps the last L - N layers whole
in VRAM (every pass computes them on the GPU) and gives each of the first N a cache of S slots. It is the
same run with those layers held whole by the cache (``lru-dist``'s ``whole_layers``, simulator/cache.py
PartitionedCache: all their experts resident from the start, never a miss). With room for C experts a layer
kept whole costs J and a cached layer S + 1, so N host layers leave S_N = floor((C - (L - N) J) / N) - 1 slots
each: fewer whole layers buy every host layer more slots. Which side wins depends on how often the cached
layers hit, so three points of the trade-off are listed and timed, none chosen from traffic: as many whole
layers as leave every host layer a slot (the least N), none (``--cpu-moe``, N = L), and halfway between.
"""

from __future__ import annotations

import re

import numpy as np

from moe_offload.engines.base import EngineModel, PlacementContext, Setting, layer_keys
from moe_offload.simulator.timed import simulate_timed
from moe_offload.simulator.timed.schedule import leading_iterations

EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # common/common.h LLM_FFN_EXPS_REGEX
# rows of the profile the L + 1 gain runs replay (its leading iterations): L + 1 timed runs of that many rows
GAIN_TOKENS = 256
ALL_GPU = ["--n-gpu-layers", "999"]
DEFAULT_INSERTS = 2  # PR #27861's --moe-expert-cache-inserts default


def cpu_layers_regex(layers) -> str:
    """The ``-ot`` pattern that sends the experts of ``layers`` (and nothing else) to the CPU."""
    return r"blk\.(" + "|".join(str(layer) for layer in sorted(layers)) + ")" + EXPS_REGEX


def expert_tensor_names(num_layers: int) -> list[str]:
    """The stacked expert tensors of a GGUF model of ``num_layers`` MoE layers."""
    return [f"blk.{layer}.ffn_{part}_exps.weight" for layer in range(num_layers) for part in ("gate", "up", "down")]


def layers_matched(pattern: str, num_layers: int) -> set[int]:
    """The layers whose expert tensors ``pattern`` finds, as llama.cpp's ``std::regex_search`` does."""
    compiled = re.compile(pattern)
    return {int(name.split(".")[1]) for name in expert_tensor_names(num_layers) if compiled.search(name)}


def layer_gains(context: PlacementContext) -> tuple[np.ndarray, np.ndarray]:
    """g_l of the module doc on the profile's leading iterations (GAIN_TOKENS rows at most), for TPOT and for
    TTFT: each of every layer on the host less that with layer l on the GPU. The TPOT gains are the TTFT ones
    where the profile decodes no second token."""
    spec = context.spec
    sample = leading_iterations(context.profile, min(GAIN_TOKENS, context.timed_tokens))
    cache_bytes = context.slots * context.expert_bytes

    def run(cpu_layers):
        result = simulate_timed(sample, context.hardware, "static-layers", cache_bytes,
                                expert_bytes=context.expert_bytes, policy_options={"cpu_layers": cpu_layers},
                                seed=context.seed)
        return result.tpot_seconds, result.ttft_seconds

    every = list(range(spec.num_layers))
    base_tpot, base_ttft = run(every)
    runs = [run([l for l in every if l != layer]) for layer in every]
    ttft = np.array([base_ttft - ttft for _, ttft in runs])
    if base_tpot is None:
        return ttft, ttft
    return np.array([base_tpot - tpot for tpot, _ in runs]), ttft


def best_gpu_layers(gains: np.ndarray, count: int, then: np.ndarray | None = None) -> list[int]:
    """The ``count`` layers of largest gain; gains equal to 1e-9 of the largest (sums of the same float terms
    in another order) are ties, broken by the ``then`` gains (TTFT's, where TPOT's tie: batch-1 decoding routes
    K experts in every layer, so every layer costs it the same), then won by the later layer, so that where
    every layer costs the same the choice is ``--n-cpu-moe``'s."""
    def rounded(values):
        scale = float(np.abs(values).max()) or 1.0
        return np.round(values / scale, 9)

    first = rounded(gains)
    second = rounded(then) if then is not None else np.zeros_like(first)
    order = sorted(range(gains.size), key=lambda layer: (-first[layer], -second[layer], -layer))
    return sorted(order[:count])


def settings(context: PlacementContext) -> list[Setting]:
    spec = context.spec
    L, J = spec.num_layers, spec.num_experts
    fit = min(L, context.slots // J)
    host = L - fit
    every = list(range(L))
    out = []
    if host == 0:
        out.append(Setting("llama.cpp", "every layer's experts in VRAM", list(ALL_GPU), "static-layers",
                           {"cpu_layers": []}, layer_keys(every, J)))
    else:
        first = list(range(host))
        label = "--cpu-moe" if host == L else f"--n-cpu-moe {host}"
        flags = ["--cpu-moe"] if host == L else ["--n-cpu-moe", str(host)]
        out.append(Setting("llama.cpp", label, ALL_GPU + flags, "static-layers", {"cpu_layers": first},
                           layer_keys(range(host, L), J), note=f"the first {host} layers' experts on the CPU"))
    if 0 < host < L and context.expert_bytes:
        tpot_gains, ttft_gains = layer_gains(context)
        gpu = best_gpu_layers(tpot_gains, fit, ttft_gains)
        cpu = [layer for layer in every if layer not in gpu]
        pattern = cpu_layers_regex(cpu)
        out.append(Setting("llama.cpp", f"-ot (layers {','.join(map(str, cpu))} on the CPU)",
                           ALL_GPU + ["-ot", f"{pattern}=CPU"], "static-layers", {"cpu_layers": cpu},
                           layer_keys(gpu, J), from_traffic=True, kind="ot",
                           note=f"the {host} layers whose experts gain least TPOT (then TTFT) in VRAM on the "
                                f"profile (the best of all {host}-layer sets: per-layer costs add up)"))
    if host > 0:
        out.append(Setting("llama.cpp", "--cpu-moe", ALL_GPU + ["--cpu-moe"], "static-layers", {"cpu_layers": every},
                           [], note="every layer's experts on the CPU"))
    if host > 0:
        out.extend(cache_setting(context, cached) for cached in cached_layer_counts(L, J, context.slots))
    return [setting for i, setting in enumerate(out) if setting.label not in {s.label for s in out[:i]}]


def cache_slots_per_layer(num_layers: int, num_experts: int, slots: int, cached: int) -> int:
    """S_N of the module doc: the cache slots each of ``cached`` host layers gets when the other layers are kept
    whole in VRAM (each cached layer takes one zero slot more), at most a layer's experts; below 1: none fits."""
    return min(num_experts, (slots - (num_layers - cached) * num_experts) // cached - 1)


def cached_layer_counts(num_layers: int, num_experts: int, slots: int) -> list[int]:
    """The numbers N of host layers with a cache that the settings list (module doc): the least N that leaves
    each a slot, L, and halfway between; none when not even L layers get a slot each."""
    fitting = [n for n in range(1, num_layers + 1) if cache_slots_per_layer(num_layers, num_experts, slots, n) >= 1]
    if not fitting:
        return []
    least = fitting[0]
    return sorted({least, (least + num_layers) // 2, num_layers})


def cache_setting(context: PlacementContext, cached: int) -> Setting:
    """``--n-cpu-moe N --moe-expert-cache S`` (``--cpu-moe`` where N = L): the first N layers on the host, each
    with a PR #27861 cache of S slots, the others whole in VRAM."""
    L, J = context.spec.num_layers, context.spec.num_experts
    slots = cache_slots_per_layer(L, J, context.slots, cached)
    whole = list(range(cached, L))
    placement = ["--cpu-moe"] if cached == L else ["--n-cpu-moe", str(cached)]
    kept = f"the last {len(whole)} layers' experts in VRAM, " if whole else ""
    return Setting("llama.cpp", f"{' '.join(placement)} --moe-expert-cache {slots} (PR #27861)",
                   ALL_GPU + placement + ["--moe-expert-cache", str(slots)], "lru-dist", {"whole_layers": whole},
                   layer_keys(whole, J), uploads=DEFAULT_INSERTS, cache_slots=slots * cached + len(whole) * J,
                   cannot_host=context.outside_host_memory("PR #27861 uploads experts from host memory"),
                   note=f"ggml-org/llama.cpp PR #27861 (open, not in a release): {kept}per host layer an LRU of "
                        f"{slots} VRAM slots (and its zero slot), misses computed on the host, {DEFAULT_INSERTS} "
                        "uploads per layer after each one-token pass, none in larger passes")


ENGINE = EngineModel(
    name="llama.cpp", command="llama-server -m MODEL.gguf",
    source="ggml-org/llama.cpp common/arg.cpp (--cpu-moe, --n-cpu-moe), common/common.h (LLM_FFN_EXPS_REGEX); "
           "ik_llama.cpp takes the same flags; PR #27861 src/llama-moecache.cpp (--moe-expert-cache)",
    settings=settings,
    limits="whole layers only: a layer's experts are one tensor, all in VRAM or all on the CPU; the per-expert "
           "cache of PR #27861 (open) serves one-token passes only")
