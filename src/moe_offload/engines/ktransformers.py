"""KTransformers through SGLang's ``kt`` backend: a fixed set of GPU experts, the CPU computes every other one.

What it expresses (kvcache-ai/sglang python/sglang/srt/layers/moe/kt_utils.py, ``_init_kt_gpu_experts_masks``;
the same ``--kt-*`` flags in sgl-project/sglang's server arguments). ``--kt-num-gpu-experts n`` is per layer:
the GPU holds n x L experts in all (L MoE layers), placed by ``--kt-expert-placement-strategy``:

* ``uniform`` (``generate_uniform_masks``): the total spread evenly over the MoE layers, n each, the first
  ones by expert id (``masks[layer, :n] = True``);
* ``front-loading`` (``generate_front_loading_masks``): fill layer 0 with all J experts, then layer 1, ...
  until the total is placed;
* ``random`` (``generate_random_masks``): ``torch.randperm`` of the L x J (layer, expert) positions with a
  generator seeded 42, the first n x L of them (PyTorch reproduces it: without PyTorch this setting is left out);
* ``frequency``: ``--init-expert-location FILE.pt`` gives activation counts (a dict with ``logical_count``
  of shape [buffer, L, J], or that tensor alone), summed over the first axis; kt-kernel's
  ``generate_gpu_experts_masks`` (kvcache-ai/ktransformers kt-kernel/python/experts_base.py) then takes the
  n x L largest counts over all layers at once (``torch.topk`` of the flattened table): some layers may get
  none. Ties: ``torch.topk(sorted=False)`` does not say which; here the lower (layer, expert) goes first.

Every expert not in the mask runs on the CPU (the wrapper masks its id to -1 for the GPU kernel), so each
strategy is a static placement, ``static-experts`` with that mask. The frequency counts come from the profile
(never from the scored traffic) and are exported in the loader's format (``write_statistics``).

``--kt-gpu-prefill-token-threshold T --kt-enable-dynamic-expert-update`` (kvcache-ai/sglang
python/sglang/srt/layers/moe/kt_ep_wrapper.py, ``apply``, ``_update_gpu_experts_from_batch``,
``select_top_experts_from_batch``): a pass of at least T tokens runs each layer on a temporary full GPU layer
(every expert of it brought over the link, none computed on the CPU), and with the update the layer's GPU
experts then become the n most routed experts of that pass. Run as the code defines it by the timed
simulator's layerwise prefill (simulator/timed/layerwise.py) on the ``frequency`` placement, with T the
profile's median prompt pass: long prompts refresh the GPU experts, shorter ones and decoding use them.

kt-kernel loads every expert into anonymous host memory at the start, the GPU's own included (kvcache-ai/
ktransformers issue #2084; keeping them in a file it maps is its open PR #2190): where the hardware's host
memory cannot hold them all, the server does not fit the machine, and no setting is timed.
"""

from __future__ import annotations

import numpy as np

from moe_offload.engines.base import EngineModel, PlacementContext, Setting
from moe_offload.errors import ConfigError
from moe_offload.outputs import atomic_output
from moe_offload.policies._profile import expert_counts
from moe_offload.simulator.timed.schedule import trace_iterations
from moe_offload.trace.format import PREFILL

STATISTICS_FILE = "kt-expert-frequency.pt"
RANDOM_SEED = 42  # generate_random_masks' fixed seed


def uniform_mask(L: int, J: int, total: int) -> list[int]:
    base, extra = divmod(total, L)
    return [layer * J + expert for layer in range(L) for expert in range(min(J, base + (layer < extra)))]


def front_loading_mask(L: int, J: int, total: int) -> list[int]:
    return list(range(min(total, L * J)))  # layer by layer from the first, experts by id


def random_mask(L: int, J: int, total: int) -> list[int] | None:
    """torch.randperm(L * J) with torch.Generator seeded 42, its first ``total`` positions; None without PyTorch."""
    try:
        import torch
    except ImportError:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(RANDOM_SEED)
    return sorted(torch.randperm(L * J, generator=generator, device="cpu")[:min(total, L * J)].tolist())


def frequency_mask(counts: np.ndarray, total: int) -> list[int]:
    """generate_gpu_experts_masks on a [L, J] count table: the ``total`` largest counts over all layers."""
    flat = counts.reshape(-1)
    return sorted(np.argsort(-flat, kind="stable")[:min(total, flat.size)].tolist())


def write_statistics(counts: np.ndarray, path: str) -> None:
    """The activation counts as ``--init-expert-location`` reads them with ``--kt-expert-placement-strategy
    frequency``: ``torch.save`` of ``{"logical_count": int64 tensor [1, L, J]}`` (the layout SGLang's
    expert-distribution recorder writes), atomically."""
    try:
        import torch
    except ImportError:
        raise ConfigError("writing KTransformers' activation counts (a .pt file) needs PyTorch: "
                          "pip install 'moe-offload[models]'") from None
    tensor = torch.as_tensor(np.asarray(counts, dtype=np.int64)[None, :, :])
    with atomic_output(path) as temporary:
        torch.save({"logical_count": tensor}, temporary)


def settings(context: PlacementContext) -> list[Setting]:
    spec = context.spec
    L, J = spec.num_layers, spec.num_experts
    per_layer = min(J, context.slots // L)
    if per_layer == 0:
        return []
    total = per_layer * L
    common = ["--kt-num-gpu-experts", str(per_layer), "--kt-expert-placement-strategy"]
    counts = expert_counts(context.profile, spec).reshape(L, J)
    out = [Setting("ktransformers", f"uniform, {per_layer} per layer", common + ["uniform"], "static-experts",
                   resident=uniform_mask(L, J, total)),
           Setting("ktransformers", "front-loading", common + ["front-loading"], "static-experts",
                   resident=front_loading_mask(L, J, total)),
           Setting("ktransformers", "frequency", common + ["frequency", "--init-expert-location", STATISTICS_FILE],
                   "static-experts", resident=frequency_mask(counts, total), from_traffic=True, kind="frequency",
                   note=f"the {total} most routed experts of the profile over all layers",
                   export=lambda path: write_statistics(counts, path), export_name=STATISTICS_FILE)]
    chosen = random_mask(L, J, total)
    if chosen is not None:
        out.append(Setting("ktransformers", "random (seed 42)", common + ["random"], "static-experts",
                           resident=chosen))
    threshold = median_prompt_pass(context.profile)
    if threshold is not None:
        frequency = out[2]
        out.append(Setting("ktransformers", f"frequency, dynamic update at {threshold}+ token passes",
                           frequency.flags + ["--kt-gpu-prefill-token-threshold", str(threshold),
                                              "--kt-enable-dynamic-expert-update"],
                           "static-experts", resident=frequency.resident,
                           layerwise={"threshold": threshold, "dynamic_update": True},
                           note=f"starts from the frequency placement; passes of {threshold} or more tokens run "
                                "every expert on the GPU (whole layers over the link) and replace each layer's GPU "
                                "experts by that pass's most routed",
                           export=frequency.export, export_name=STATISTICS_FILE))
    held = context.outside_host_memory("kt-kernel loads every expert into host memory, those on the GPU too "
                                       "(kvcache-ai/ktransformers issue #2084)")
    for setting in out:
        setting.options = {"experts": setting.resident}
        setting.cannot_host = held
    return out


def median_prompt_pass(trace) -> int | None:
    """The median of the token counts of the profile's prefill passes of more than one token (rounded down), or
    None without such a pass (a threshold of one token would send every decoding step down the fallback)."""
    sizes = [int(rows.size) for rows in trace_iterations(trace)
             if rows.size > 1 and (trace.phase[rows] == PREFILL).any()]
    return int(np.median(sizes)) if sizes else None


ENGINE = EngineModel(
    name="ktransformers", command="python -m sglang.launch_server --model MODEL --kt-weight-path WEIGHTS",
    source="kvcache-ai/sglang python/sglang/srt/layers/moe/kt_utils.py (masks), kt_ep_wrapper.py (layerwise prefill, "
           "dynamic expert update), kvcache-ai/ktransformers kt-kernel/python/experts_base.py "
           "(generate_gpu_experts_masks)",
    settings=settings, reads_files=True,
    limits="a GPU set of n experts per layer on average, changed only by a long prefill (dynamic update); "
           "misses are computed on the CPU, never loaded")
