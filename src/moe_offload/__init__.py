"""moe-offload: serve Mixture-of-Experts models whose experts do not fit in fast memory.

Layout: ``trace`` (format, importers, generators), ``policies`` (one eviction policy per file),
``prefetch`` (one prefetcher per file), ``simulator`` (cache, replay, timed), ``hardware`` (profiles),
``models`` (transformers adapters, the bundled model, the recorder), ``runtime`` (packed checkpoints, tiers,
engine), ``text`` (offline corpora and prompts), ``reporting`` (result record, tables, plots), ``cli``.

``moe_offload.load(...)`` starts the runtime (see moe_offload.api).
"""

from moe_offload.version import __version__

__all__ = ["__version__", "load"]


def load(*args, **kwargs):
    """See :func:`moe_offload.api.load` (imported lazily: the replay side never needs PyTorch)."""
    from moe_offload.api import load as _load

    return _load(*args, **kwargs)
