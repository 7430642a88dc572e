"""Layerwise prefill and the dynamic expert update of KTransformers' SGLang backend (kvcache-ai/sglang
python/sglang/srt/layers/moe/kt_ep_wrapper.py: ``KTEPWrapperMethod.apply``, ``_update_gpu_experts_from_batch``,
``select_top_experts_from_batch``; flags ``--kt-gpu-prefill-token-threshold T`` and
``--kt-enable-dynamic-expert-update``).

What the backend does, and how the timed run follows it. Each layer keeps its GPU experts (the static
placement of ``--kt-num-gpu-experts``, ``static-experts`` here) and the CPU computes the others. A pass of at
least T tokens (T > 0) takes the full-GPU fallback instead: the layer's whole expert set is brought to the
GPU (a temporary full layer: here every one of its J experts crosses the host link, the compute stream
waiting for them) and every routed expert runs there, none on the CPU. With the dynamic update, right after
such a layer the n experts that pass routed most in it (n: the layer's GPU experts; ties to the lower expert
id; experts the pass did not route fill the rest, lowest id first, as ``torch.topk`` over the counts
breaks ties) replace the layer's GPU experts, copied from the temporary layer (on the GPU: no link time), and
stay until the next such pass. A pass of fewer tokens is the static placement's: resident experts on the
GPU, the others on the host.

The run counts a fallback layer's resident routed experts as hits and the others as misses loaded with the
layer (its bytes are the whole layer's, J experts).
"""

from __future__ import annotations

from moe_offload.errors import ConfigError
from moe_offload.values import integer

SOURCE = "KTransformers' layerwise prefill (kt_ep_wrapper.py)"


class LayerwisePrefill:
    """``threshold``: the least tokens of a pass that takes the full-GPU fallback; ``dynamic_update``: whether
    such a pass then replaces each layer's GPU experts (module doc)."""

    def __init__(self, threshold: int, dynamic_update: bool = False):
        self.threshold = integer(threshold, "--kt-gpu-prefill-token-threshold", low=1)
        self.dynamic_update = bool(dynamic_update)
        self.passes = 0    # fallback passes run
        self.replaced = 0  # GPU experts replaced by the dynamic update

    def takes(self, tokens: int) -> bool:
        """Whether a pass of ``tokens`` tokens takes the full-GPU fallback."""
        return tokens >= self.threshold

    @staticmethod
    def most_routed(keys: list[int], counts: list[int], n: int, layer: int, num_experts: int) -> list[int]:
        """``select_top_experts_from_batch`` on one layer: the ``n`` experts of most tokens routed, ties and the
        unrouted fill to the lower expert id, as flat keys."""
        routed = dict(zip(keys, counts))
        first = layer * num_experts
        ranked = sorted(range(first, first + num_experts), key=lambda key: (-routed.get(key, 0), key))
        return sorted(ranked[:n])

    def update(self, cache, ctx, layer: int, keys: list[int], counts: list[int], num_experts: int,
               expert_bytes: int) -> None:
        """After a fallback layer: its GPU experts in ``cache`` become the pass's most routed (module doc)."""
        if not self.dynamic_update:
            return
        first = layer * num_experts
        resident = [key for key in range(first, first + num_experts) if key in cache]
        chosen = self.most_routed(keys, counts, len(resident), layer, num_experts)
        leaving = [key for key in resident if key not in chosen]
        for key in leaving:
            cache.evict(key)
        for key in chosen:
            if key not in cache:
                cache.reserve(key, ctx, expert_bytes)
                cache.complete(key, ctx)
        self.replaced += len(leaving)


def check_layerwise(policy_static: bool, partitioned: bool, home: int | None, hardware_name: str) -> None:
    """ConfigError unless the run is a static placement on one cache, as KTransformers' GPU experts are, with the
    experts in host memory (the tier after the GPU), where the backend keeps them."""
    if not policy_static or partitioned:
        raise ConfigError(f"{SOURCE} replaces a static placement's GPU experts: give static-experts")
    if home != 1:
        raise ConfigError(f"hardware {hardware_name}: {SOURCE} brings layers from host memory, but the experts do "
                          "not fit in the tier after the GPU")
