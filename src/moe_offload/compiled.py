"""Numba, when it is installed: whether it is, and a function compiled with Numba's on-disk cache.

This module is the only one that imports Numba, and only inside its functions, when a compiled function is
first asked for: the package imports and runs without it (``pip install 'moe-offload[fast]'`` adds it). It
sits at the bottom of the package, beside ``values`` and ``inputs``, because the layers that compile code
(the trace's flattening and next-use times, the prefetchers' searches, the replay's policy kernels in
simulator/kernels.py, the stack distances, the report's working-set scan) sit at different heights and all
use it. Every function is compiled with the same flags: an explicit signature (compiled once, when first asked
for), Numba's on-disk cache where a folder is writable, and ``nogil``, so that kernels run side by side on
threads of one process (the replay grid) instead of in worker processes that would need copies of the
request sequence.

A kernel whose plain Python runs in a second or so on a short input is compiled only where the work pays for
the compile (``compile_pays``): Numba's first compile of a kernel costs seconds of CPU (once per machine, its
cache keeps it after), more than the plain function takes on a short trace, and the results are the same,
the function being the same.
"""

from __future__ import annotations

import functools

INSTALL_HINT = "install Numba for the compiled replay: pip install 'moe-offload[fast]'"


@functools.cache
def numba_available() -> bool:
    try:
        import numba  # noqa: F401  (an optional dependency: imported only to ask whether it is there)
    except ImportError:
        return False
    return True


def compile_pays(work: int, python_below: int) -> bool:
    """Whether a kernel runs compiled on ``work`` (its requests, say): Numba is installed and the work is at
    least ``python_below``, the work at which the kernel's plain Python takes about as long as its first
    compile (module docstring)."""
    return work >= python_below and numba_available()


def njit_cached(function, signature):
    """``function`` compiled for ``signature`` by Numba, releasing the GIL while it runs, kept in Numba's
    on-disk cache where it can be."""
    import numba  # an optional dependency (module docstring)

    try:
        return numba.njit(signature, cache=True, nogil=True)(function)
    except RuntimeError as exc:  # no folder to cache in (read-only install, no writable home)
        if "cannot cache" not in str(exc):
            raise
        return numba.njit(signature, nogil=True)(function)
