"""Compiled replay: each policy's ``replay_kernel`` compiled with Numba, when Numba is installed.

Where the kernels live, and why there. A kernel is a static method of its policy's class, in the policy's own
file, under the Python hooks it mirrors: a reader finds a policy's formula (the class docstring), its
reference implementation (the hooks the cache calls) and its compiled form in one file, and whoever changes
one has the other in view. A separate package of kernels would put every policy in two places. The kernels are
written in the subset of Python that Numba compiles (NumPy arrays indexed by flat expert id, no objects), so
they also run as plain Python, slowly: that is how the tests check them where Numba is missing. The data
structures several kernels share sit beside their Python twins: the keyed heap in policies/_ranked.py, the
linked lists in policies/_linked.py, the Mersenne Twister in policies/_seeded.py. This module is the only one
that compiles the policies' kernels, with the helpers of compiled.py (the only module that imports Numba), and
only when a kernel is first asked for: the package imports and replays without Numba.

The contract. ``replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits)``
serves, in order, the requests of a flattened sequence (its arrays ``keys``, flat expert ids, and ``tokens``,
int32 as the sequence's columns are) on one demand-paged cache of ``capacity`` experts that starts empty,
exactly as ExpertCache.request with the policy object would: request t has clock t, key ``keys[t]`` and token
``tokens[t]`` (AccessContext's fields, for the policies that read them); the offline policy, Belady's, finds
each request's next use itself, a chunk at a time (trace/flatten.py ``fill_next_uses``); ``floats`` and
``ints`` are the policy's ``run_kernel_arguments(capacity, trace)`` (parameters, a generator's state, which the
kernel may update; a static placement's experts, the requests a row belongs to); it adds each hit to
``key_hits[key]`` (the replay sums them by layer after: a division per hit cost LRU's and Belady's kernels
about a tenth of their time). The whole replay passes the whole sequence; a -dist policy is a cache
split among the layers (simulator/partitioned_cache.py), so the replay runs the kernel once per layer on
that layer's requests, gathered a group of layers at a time (AccessSequence.layer_columns), and its share
of the capacity, as the partitions would: the same requests in the same order, their clocks counted in the
layer (the -dist policies' decisions depend on the order of their requests only; the tests replay them both
ways). No kernel reads a column of positions or of next uses: at 20M requests each would be 80 MB to make and
to stream through the loop, which cost more than LRU's replay.

Compilation. ``compiled_kernel(policy_class)`` compiles the kernel and every plain function it calls (found
among the names its code uses, recursively) with an explicit signature, so a kernel compiles once, when first
asked for, and never again for other argument types; the replay asks before it starts, so compile time is not
replay time. A kernel releases the GIL (``nogil``): the replay grid runs kernels on threads of one process, which
share the request sequence instead of copying it to worker processes. Numba's on-disk cache
(``cache=True``) keeps the machine code for the next process: in ``__pycache__`` beside the policy's file,
or, where that is read-only (an installed package), in Numba's per-user cache folder (or NUMBA_CACHE_DIR);
where no folder is writable the kernel is compiled in memory only. Numba's cache notices a change to the
kernel's own file but not to the helpers it calls in other files, so the compiled name carries a digest of
the bytecode of the kernel and all its helpers, and of the module constants they read (Numba freezes those
into the machine code): any change to any of them is a new cache entry.
"""

from __future__ import annotations

import functools
import hashlib
import types

import numpy as np

from moe_offload.compiled import (INSTALL_HINT, PIPELINE, compiled_twin,  # noqa: F401  (kernels.INSTALL_HINT)
                                   njit_cached, numba_available)

SIGNATURE = "void(int32[::1], int32[::1], int64, int64, int64, float64[::1], int64[::1], int64[::1])"
HELPER_OPTIONS = {"inline": "always"}  # no call, hence no reference counting of array arguments, per helper use
COMPILE_FLAGS = "nogil"  # moe_offload/compiled.py's flags, in the digest: a change of them is a new cache entry


@functools.cache
def compiled_kernel(policy_class):
    """The compiled ``replay_kernel`` of ``policy_class``; None when it has none or Numba is not installed.
    The first call in a process compiles it, or loads it from Numba's cache."""
    function = policy_class.replay_kernel  # a static method: the plain function
    if function is None or not numba_available():
        return None
    return compile_linked(function, SIGNATURE)


def compile_linked(function, signature: str):
    """``function`` and every plain function it calls compiled by Numba for ``signature`` (Numba must be
    installed), named with their digest so that Numba's cache never serves an older version (module doc)."""
    import numba  # an optional dependency (compiled.py)

    helpers: dict = {}
    linked = _link(function, numba, helpers)
    linked.__qualname__ = f"{function.__qualname__}_{_digest(function, helpers, signature)}"
    return njit_cached(linked, signature)


def _link(function, numba, helpers: dict):
    """A copy of ``function`` whose calls to plain Python functions go to their Numba dispatchers (or to their
    compiled twins, compiled.py)."""
    namespace = dict(function.__globals__)
    for name in _names(function.__code__):
        value = namespace.get(name)
        if isinstance(value, types.FunctionType):
            if value not in helpers:
                helpers[value] = None  # a placeholder: recursion terminates on cycles
                twin = compiled_twin(value)
                if twin is not None:  # its code in the digest too: a change of it is a new cache entry
                    helpers[twin.py_func] = helpers[value] = twin
                else:
                    helpers[value] = numba.njit(**HELPER_OPTIONS)(_link(value, numba, helpers))
            namespace[name] = helpers[value]
    linked = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                                function.__closure__)
    linked.__qualname__ = function.__qualname__
    return linked


def _names(code) -> set[str]:
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _names(constant)
    return names


def _digest(function, helpers: dict, signature: str) -> str:
    """A short hash of the bytecode, constants and names of ``function`` and its helpers, of the module-level
    constants they read, and of how they are compiled."""
    hasher = hashlib.sha256(repr((signature, HELPER_OPTIONS, COMPILE_FLAGS, PIPELINE)).encode())
    for part in [function] + sorted(helpers, key=lambda f: (f.__code__.co_filename, f.__code__.co_qualname)):
        _hash_code(part.__code__, hasher)
        _hash_globals(part, hasher)
    return hasher.hexdigest()[:12]


def _hash_globals(function, hasher) -> None:
    """The plain values (numbers, strings, tuples of them) that ``function`` reads from its module's globals:
    Numba freezes them into the machine code, so a change of one (coact's COUNT_LIMIT in _coact_tokens.py, say)
    must be a new cache entry too, as a change of code is."""
    for name in sorted(_names(function.__code__)):
        value = function.__globals__.get(name)
        if _is_plain(value):
            hasher.update(f"{name}={value!r}".encode())


def _is_plain(value) -> bool:
    if isinstance(value, tuple):
        return all(_is_plain(item) for item in value)
    return isinstance(value, (bool, int, float, complex, str, bytes, np.generic))


def _hash_code(code, hasher) -> None:
    hasher.update(code.co_qualname.encode())
    hasher.update(code.co_code)
    hasher.update(repr(code.co_names).encode())
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            _hash_code(constant, hasher)
        else:
            hasher.update(repr(constant).encode())
