"""moe-offload: serve Mixture-of-Experts models whose experts do not fit in fast memory.

Layout: ``trace`` (format, importers, generators), ``policies`` (one eviction policy per file),
``simulator`` (cache and replay), ``reporting`` (result record, tables, plots), ``cli``.
"""

__version__ = "0.1.0"
