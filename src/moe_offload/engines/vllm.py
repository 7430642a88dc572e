"""vLLM: whole expert tensors read from host memory in every forward pass, or the per-expert LFRU cache of its
PR #37190.

* ``--cpu-offload-gb G --cpu-offload-params experts`` (vllm-project/vllm vllm/config, OffloadConfig's
  ``cpu_offload_params``: parameter name segments, ``experts`` matching ``mlp.experts.w13_weight`` and
  ``w2_weight``; vllm/model_executor/offloader/uva.py ``UVAOffloader``): the decoder layers are wrapped in
  order, and the matching parameters of the first layers move to pinned host memory until G GiB are
  offloaded. With UVA (the default where available) the GPU reads them over the link in place, in every
  forward pass; without it (``VLLM_WEIGHT_OFFLOADING_DISABLE_UVA``) each offloaded module's whole state is
  copied to the GPU before its forward. Nothing is kept: with room for F = floor(C / J) layers, the first
  L - F layers' experts cross the link in every pass, at least the routed ones (UVA reads what the kernel
  touches). The timed simulator has no expert read in place and never kept, so this setting is reported by
  its bytes: the distinct experts each pass routes in the offloaded layers, times the expert size, per token
  (``streamed_bytes_per_token``), a lower bound on what crosses the link.
* ``--moe-expert-cache-size N`` (PR #37190, open, not merged; ``CachedWeightProvider``): every layer keeps
  a GPU cache of N experts, a miss is copied from pinned host memory on demand (synchronously, in
  ``prepare()``), and the victim is chosen by LFRU: ``lfru-dist`` (policies/lfru.py, the rule derived there).
"""

from __future__ import annotations

import numpy as np

from moe_offload.engines.base import EngineModel, PlacementContext, Setting, layer_keys
from moe_offload.simulator.timed.schedule import trace_iterations
from moe_offload.trace.format import Trace


def streamed_bytes_per_token(trace: Trace, layers, expert_bytes: int) -> float:
    """The distinct experts each of ``trace``'s passes routes in ``layers``, times ``expert_bytes``, per token."""
    layers = sorted(layers)
    if not layers or trace.num_tokens == 0:
        return 0.0
    total = 0
    for rows in trace_iterations(trace):
        routed = trace.experts[rows][:, layers, :]
        total += sum(np.unique(routed[:, i, :]).size for i in range(len(layers)))
    return total * expert_bytes / trace.num_tokens


def settings(context: PlacementContext) -> list[Setting]:
    spec = context.spec
    L, J = spec.num_layers, spec.num_experts
    fit = min(L, context.slots // J)
    offloaded = list(range(L - fit))
    out = []
    if offloaded and context.expert_bytes:
        gib = len(offloaded) * J * context.expert_bytes / 2**30
        setting = Setting("vllm", f"--cpu-offload-gb {gib:.4g} (first {len(offloaded)} layers' experts)",
                          ["--cpu-offload-gb", f"{gib:.4g}", "--cpu-offload-params", "experts"], None,
                          resident=layer_keys(range(L - fit, L), J),
                          note="read over the link in every pass, never kept (UVA): not simulated, bytes only",
                          streamed_layers=offloaded)
        out.append(setting)
    per_layer = context.slots // L
    if per_layer >= 1:
        out.append(Setting("vllm", f"--moe-expert-cache-size {per_layer} (PR #37190)",
                           ["--moe-expert-cache-size", str(per_layer)], "lfru-dist",
                           note="vllm-project/vllm PR #37190 (open, not merged): LFRU cache of "
                                f"{per_layer} experts per layer, misses copied on demand"))
    return out


ENGINE = EngineModel(
    name="vllm", command="vllm serve MODEL",
    source="vllm-project/vllm vllm/model_executor/offloader/uva.py (--cpu-offload-gb, --cpu-offload-params); "
           "PR #37190 (--moe-expert-cache-size, LFRU)",
    settings=settings,
    limits="released vLLM offloads whole tensors of the first layers, read over the link in every pass; a "
           "per-expert cache exists only in the open PR #37190")
