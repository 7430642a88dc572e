"""The engines users run, and the placements each can express at a memory budget, built from this project's
one cache, admission and host-compute mechanisms (one file per engine; base.py: what they share; heldout.py:
choosing on one part of the traffic and scoring on the rest)."""

from moe_offload.engines import ktransformers, llamacpp, sglang, vllm
from moe_offload.engines.base import EngineModel, PlacementContext, Setting, run_setting
from moe_offload.errors import ConfigError
from moe_offload.engines.heldout import Split, served_share, split_trace, window_hit_rates

ENGINES: dict[str, EngineModel] = {model.ENGINE.name: model.ENGINE for model in (llamacpp, ktransformers, vllm, sglang)}


def engine_names(value: str) -> list[str]:
    """``--engine``: one engine's name, or ``all``."""
    if value == "all":
        return list(ENGINES)
    if value not in ENGINES:
        raise ConfigError(f"--engine {value!r}: choose one of {', '.join(ENGINES)} or all")
    return [value]


__all__ = ["ENGINES", "EngineModel", "PlacementContext", "Setting", "Split", "engine_names", "run_setting",
           "served_share", "split_trace", "window_hit_rates"]
