"""The Python entry point of the runtime.

    import moe_offload
    engine = moe_offload.load("tiny", fast_budget="30%", policy="lru", prefetch="moepic")
    result = engine.generate("User: what is a cache?\\nAssistant:", max_new_tokens=32)
    print(result.text, result.tokens_per_second, result.stats.hit_rate)
    engine.stats      # everything since load, the same RunResult record the simulators fill
    engine.close()
"""

from __future__ import annotations


def load(model: str = "tiny", *, fast_budget="50%", policy: str = "lru", prefetch: str | None = None,
         prefetch_history=None, expert_dtype: str | None = None, **options):
    """An :class:`~moe_offload.runtime.engine.OffloadEngine` for ``model`` (``tiny``, a checkpoint directory,
    packed once into the cache, or a packed directory; a hub id ORG/NAME[@REVISION]), its experts stored as
    ``expert_dtype`` (float16, bfloat16, int8, int4; None: as the checkpoint stores them). ``options`` go to the engine (host_budget, device,
    policy_options, prefetch_options, bypass_page_cache, verify_checksums, preload, split_config, ...)."""
    from moe_offload.models import require_model_stack

    require_model_stack("the runtime")
    from moe_offload.bundled import TINY_HISTORY_TRACE
    from moe_offload.prefetch import Prefetcher, prefetcher_info
    from moe_offload.runtime.engine import OffloadEngine
    from moe_offload.runtime.pack_cache import packed_directory

    if prefetch is not None and prefetch_history is None and model == "tiny" \
            and prefetcher_info(prefetch).fit is not Prefetcher.fit:
        prefetch_history = TINY_HISTORY_TRACE  # the same model on other prompts: MoE-Infinity, fMoE learn from it
    return OffloadEngine(packed_directory(model, expert_dtype=expert_dtype), fast_budget=fast_budget, policy=policy, prefetch=prefetch,
                         prefetch_history=prefetch_history, **options)
