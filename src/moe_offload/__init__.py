"""moe-offload: serve Mixture-of-Experts models whose experts do not fit in fast memory.

Layers, highest first (docs/architecture.md; ``lint-imports`` checks them): ``cli``; ``api``; ``server`` and
``sweep``; ``runtime`` (packed checkpoints, tiers, engine); ``reporting`` (tables, plots, the report) and
``training``; ``engines`` (the engines users run and their placements); ``simulator`` (cache, transfer queue,
replay, split, configurator, timed); ``hardware`` (profiles), ``models`` (transformers adapters, the experts
function, the recorder) and ``prefetch`` (one prefetcher per file); ``policies`` (one eviction policy per file);
``trace`` (format, importers, generators); ``text`` (offline corpora and prompts); the base modules
(``results``: the one result record, ``values``, ``inputs``, ``outputs``, ``bundled``, ``compiled``,
``version``); ``errors``.

``moe_offload.load(...)`` starts the runtime (see moe_offload.api).
"""

from moe_offload.version import __version__

__all__ = ["__version__", "load"]


def load(*args, **kwargs):
    """See :func:`moe_offload.api.load` (imported lazily: the replay side never needs PyTorch)."""
    from moe_offload.api import load as _load

    return _load(*args, **kwargs)
