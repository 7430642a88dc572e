"""Prefetchers, one file each, behind moe_offload.prefetch.base.Prefetcher.

``PREFETCHERS`` maps the command-line name of every prefetcher to its class; ``prefetcher_info(name)``
looks one up, ``make_prefetcher(name, spec, options)`` builds one with checked options, and
``check_trace_columns(cls, trace)`` refuses a trace that lacks a column the prefetcher ``requires``.
``search_latency(prefetcher)`` is what the last hook call's history search cost and whether it delays
inference (moe_offload.prefetch.search_cost explains both).
"""

from __future__ import annotations

from moe_offload.errors import ConfigError
from moe_offload.policies.base import ModelSpec
from moe_offload.prefetch.base import Prefetcher, Proposal, RoutingView
from moe_offload.prefetch.fmoe import FMoEPrefetcher
from moe_offload.prefetch.mixtral_offloading import MixtralOffloadingPrefetcher
from moe_offload.prefetch.moe_infinity import MoEInfinityPrefetcher
from moe_offload.prefetch.moepic import MoEpicPrefetcher
from moe_offload.prefetch.oracle import OraclePrefetcher
from moe_offload.prefetch.pre_gated import PreGatedPrefetcher
from moe_offload.prefetch.requirements import check_trace_columns
from moe_offload.prefetch.topk import TopKPrefetcher
from moe_offload.prefetch.traced_topk import TracedTopKPrefetcher
from moe_offload.values.options import check_option_names, option_defaults

PREFETCHERS: dict[str, type[Prefetcher]] = {
    cls.name: cls
    for cls in (
        TopKPrefetcher,
        TracedTopKPrefetcher,
        MoEInfinityPrefetcher,
        FMoEPrefetcher,
        MoEpicPrefetcher,
        MixtralOffloadingPrefetcher,
        PreGatedPrefetcher,
        OraclePrefetcher,
    )
}


def prefetcher_info(name: str) -> type[Prefetcher]:
    try:
        return PREFETCHERS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown prefetcher {name!r}; choose from {', '.join(PREFETCHERS)}") from None


def prefetcher_options(name: str) -> dict[str, object]:
    """The options a prefetcher takes and their defaults."""
    return option_defaults(prefetcher_info(name))


def make_prefetcher(name: str, spec: ModelSpec, options: dict | None = None) -> Prefetcher:
    """Build prefetcher ``name`` for ``spec``; an option it does not take is a ConfigError naming those it does,
    and the constructor checks the values (moe_offload.values), with the same words as ``--prefetch-option``."""
    cls = prefetcher_info(name)
    check_option_names("prefetcher", name, cls, options)
    return cls(spec, **(options or {}))


def search_latency(prefetcher: Prefetcher) -> tuple[float, bool]:
    """(seconds the last hook call's search took, whether they delay the inference path)."""
    return prefetcher.last_search_seconds, prefetcher.search_on_inference_path


__all__ = ["PREFETCHERS", "prefetcher_info", "prefetcher_options", "make_prefetcher", "check_trace_columns",
           "search_latency", "Prefetcher", "Proposal", "RoutingView", "ModelSpec"]
