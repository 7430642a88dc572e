"""Whole layers' experts streamed to the GPU over the host link: KTransformers' layerwise prefill and dynamic expert
update, and the layer offloaders of vLLM and SGLang, which copy a few offloaded layers ahead.

**KTransformers** (kvcache-ai/sglang python/sglang/srt/layers/moe/kt_ep_wrapper.py: ``KTEPWrapperMethod.apply``,
``_update_gpu_experts_from_batch``, ``select_top_experts_from_batch``; flags ``--kt-gpu-prefill-token-threshold
T`` and ``--kt-enable-dynamic-expert-update``). Each layer keeps its GPU experts (the static placement of
``--kt-num-gpu-experts``, ``static-experts`` here) and the CPU computes the others. A pass of at least T tokens
(T > 0) takes the full-GPU fallback instead: the layer's whole expert set is brought to the GPU when its experts
are routed (a temporary full layer: every one of its J experts crosses the host link, the compute stream
waiting for them) and every routed expert runs there, none on the CPU. With the dynamic update, right after
such a layer the n experts that pass routed most in it (n: the layer's GPU experts; ties to the lower expert
id; experts the pass did not route fill the rest, lowest id first, as ``torch.topk`` over the counts breaks
ties) replace the layer's GPU experts, copied from the temporary layer (on the GPU: no link time), and stay
until the next such pass. A pass of fewer tokens is the static placement's: resident experts on the GPU, the
others on the host.

**The layer offloaders** (vllm-project/vllm vllm/model_executor/offloader/prefetch.py, ``PrefetchOffloader``,
flags ``--offload-group-size G --offload-num-in-group n --offload-prefetch-step s --offload-params experts``;
SGLang's ``OffloaderV2``, python/sglang/srt/utils/offloader.py, which vLLM's adapts). In each group of G decoder
layers the last n keep their experts in pinned host memory; the others keep theirs in VRAM. Every pass copies
each offloaded layer's whole expert set into a GPU buffer, whatever it routes: after the k-th offloaded layer
has run, one copy stream starts the copy of the (k + s)-th (counted circularly over the offloaded layers, so
the last ones of a pass bring the first ones of the next; the first s were copied when the server started),
into the memory the k-th has just freed (vLLM: s static buffers of one layer each; SGLang allocates each
copy and frees a layer's once it has run, so s layers' experts, and one more for an instant). The compute
waits for a layer's copy before that layer: vLLM wraps the whole decoder layer, so before its attention;
SGLang wraps the experts' module, so once the router has run (``before_attention``). Copies follow one
another on the copy stream.

In both, a streamed layer's resident routed experts count as hits and the others as misses that came with
the layer (its bytes are the whole layer's, J experts); all of them run on the GPU.
"""

from __future__ import annotations

from moe_offload.errors import ConfigError
from moe_offload.values import integer

KTRANSFORMERS = "KTransformers' layerwise prefill (kt_ep_wrapper.py)"


class StreamedLayers:
    """``threshold``: the least tokens of a pass that streams; ``layers``: the layers streamed (None: every one);
    ``prefetch_step``: 0, a layer is brought when its experts are routed (KTransformers); s >= 1, s streamed
    layers ahead on a copy stream of their own (the offloaders); ``before_attention``: the compute waits for a
    layer's copy before its attention rather than once it is routed; ``dynamic_update``: such a pass then
    replaces each layer's GPU experts (KTransformers); ``source``: the mechanism, for messages (module doc)."""

    def __init__(self, threshold: int = 1, dynamic_update: bool = False, layers=None, prefetch_step: int = 0,
                 before_attention: bool = False, source: str = KTRANSFORMERS):
        self.source = source
        self.threshold = integer(threshold, "--kt-gpu-prefill-token-threshold" if source == KTRANSFORMERS
                                 else "the streaming threshold", low=1)
        self.prefetch_step = integer(prefetch_step, "--offload-prefetch-step", low=0)
        self.dynamic_update = bool(dynamic_update)
        self.before_attention = bool(before_attention)
        self.layers = None if layers is None else sorted({integer(layer, "streamed layer", low=0) for layer in layers})
        if self.prefetch_step and (self.threshold != 1 or self.dynamic_update or not self.layers):
            raise ConfigError(f"{source}: copies ahead stream some layers in every pass, with no update")
        if self.prefetch_step > len(self.layers or ()):
            raise ConfigError(f"{source}: --offload-prefetch-step {self.prefetch_step} is more than the "
                              f"{len(self.layers)} offloaded layers")
        if self.before_attention and not self.prefetch_step:
            raise ConfigError(f"{source}: a layer brought when routed cannot be awaited before its attention")
        self._index = {layer: index for index, layer in enumerate(self.layers or ())}
        # a copied layer: when its copy lands; the first s were copied when the server started, before any pass
        self.landed: dict[int, float] = {layer: 0.0 for layer in (self.layers or [])[:self.prefetch_step]}
        self.copy_stream_free = 0.0
        self.passes = 0    # passes that streamed
        self.replaced = 0  # GPU experts replaced by the dynamic update

    def takes(self, tokens: int) -> bool:
        """Whether a pass of ``tokens`` tokens streams."""
        return tokens >= self.threshold

    def streams(self, layer: int) -> bool:
        return self.layers is None or layer in self._index

    def copy_after(self, layer: int) -> int:
        """The streamed layer whose copy starts once ``layer`` has run."""
        return self.layers[(self._index[layer] + self.prefetch_step) % len(self.layers)]

    def copy(self, layer: int, now: float, seconds: float) -> tuple[float, float]:
        """Start ``layer``'s copy at ``now`` or once the copy stream is free; its (start, end)."""
        start = max(now, self.copy_stream_free)
        self.copy_stream_free = self.landed[layer] = start + seconds
        return start, self.copy_stream_free

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
        """After a streamed layer: with the dynamic update its GPU experts in ``cache`` become the pass's most
        routed (module doc)."""
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

    def check(self, policy_static: bool, partitioned: bool, home: int | None, hardware_name: str, num_layers: int,
              buffer_room: int, layer_bytes: int) -> None:
        """ConfigError unless the run is a static placement on one cache, as KTransformers' GPU experts and the
        offloaders' VRAM layers are, with the experts in host memory (the tier after the GPU), where both keep
        them, the streamed layers are the model's, and the offloaders' buffers fit beside the cache
        (``buffer_room`` bytes of the GPU left, ``layer_bytes`` a layer's experts)."""
        if not policy_static or partitioned:
            raise ConfigError(f"{self.source} streams layers beside a static placement: give static-experts or "
                              "static-layers")
        if home != 1:
            raise ConfigError(f"hardware {hardware_name}: {self.source} brings layers from host memory, but the "
                              "experts do not fit in the tier after the GPU")
        if self.layers is not None and self.layers[-1] >= num_layers:
            raise ConfigError(f"{self.source}: layer {self.layers[-1]} streamed, but the model has {num_layers}")
        if self.prefetch_step * layer_bytes > buffer_room:
            raise ConfigError(f"hardware {hardware_name}: {self.source}'s {self.prefetch_step} buffer(s) of a "
                              f"layer's experts ({self.prefetch_step * layer_bytes:,} bytes) do not fit beside the "
                              f"cache ({buffer_room:,} bytes left on the GPU)")
