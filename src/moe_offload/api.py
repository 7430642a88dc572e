"""The Python entry point of the runtime.

    import moe_offload
    engine = moe_offload.load("tiny", fast_budget="30%", policy="lru", prefetch="moepic")
    result = engine.generate("User: what is a cache?\\nAssistant:", max_new_tokens=32)
    print(result.text, result.tokens_per_second, result.stats.hit_rate)
    engine.stats      # everything since load, the same RunResult record the simulators fill
    engine.plan       # what decides the run (plan/plan.py); engine.stats.configuration reports it back
    engine.close()
"""

from __future__ import annotations


def load(model: str = "tiny", *, store=None, **options):
    """An :class:`~moe_offload.runtime.engine.OffloadEngine` for ``model`` (``tiny``, a checkpoint directory,
    packed once into the cache, or a packed directory; a hub id ORG/NAME[@REVISION]; a GGUF file), made from the
    Plan of ``options`` (:func:`moe_offload.plan.make_plan`'s keywords: fast_budget, host_budget, policy,
    policy_options, prefetch, prefetch_options, prefetch_history, expert_dtype, dtype, expert_compute, device,
    hardware, fetch_or_compute, split_config, reconfiguration, max_batch, batch_math, ...). ``store``: the slow
    tier's reader, when not the plan's own (runtime/storage.py)."""
    from moe_offload.models import require_model_stack

    require_model_stack("the runtime")
    from moe_offload.plan import make_plan
    from moe_offload.runtime.engine import OffloadEngine

    return OffloadEngine(make_plan(model, **options), store=store)
