"""compiled.py's pass ``forward_copies``: which copies it forwards (only those that always hold one value made
outside every loop), and functions compiled with it computing what their plain Python computes, where a helper
inlined in a loop reads and writes arrays through its parameters and through a tuple of them."""

from __future__ import annotations

import numpy as np
import pytest

from moe_offload import compiled
from moe_offload.compiled import forward_copies, numba_available, pipeline_with_forward_copies

pytestmark = pytest.mark.skipif(not numba_available(), reason="Numba is not installed")


def compile_uncached(function, signature):
    """As compiled.njit_cached compiles, without Numba's cache: the pass runs in every test run."""
    import numba

    return numba.njit(signature, nogil=True, pipeline_class=pipeline_with_forward_copies())(function)


def copies_and_items(a, n):
    pair = (a, a)
    first = pair[0]    # an item of a tuple built before the loop: always a
    alias = a          # a copy of an argument: always a
    total = 0
    for i in range(n):
        view = a[i:]   # a new array at every turn
        same = view    # a copy of it holds another value at every turn: kept
        total += same[0] + first[i] + alias[i]
    return total


def test_copies_of_values_made_once_outside_loops_are_forwarded_and_no_others(monkeypatch):
    found = []
    monkeypatch.setattr(compiled, "forward_copies", lambda func_ir: found.append(forward_copies(func_ir)) or found[-1])
    function = compile_uncached(copies_and_items, "int64(int64[::1], int64)")
    assert function(np.arange(5, dtype=np.int64), 3) == copies_and_items(np.arange(5, dtype=np.int64), 3)
    mapping = found[0]  # the pass sees the function after Numba's rewrites and single-assignment form
    assert mapping["first"].name == "a"
    assert mapping["alias"].name == "a"
    assert "same" not in mapping and "view" not in mapping and "total" not in mapping


def lists_of(num_keys):
    return np.full(num_keys, -1, np.int64), np.zeros(num_keys, np.int64), np.zeros(2, np.int64)


def count_and_link(lists, key, previous_key):
    following, counts, ends = lists
    counts[key] += 1
    if previous_key >= 0:
        following[previous_key] = key
    else:
        ends[0] = key
    ends[1] = key


def link_all(keys, out):
    """Through helpers given a tuple of arrays made before the loop, and a copy of an array made in it."""
    lists = lists_of(out.shape[0])
    previous_key = -1
    for t in range(keys.shape[0]):
        key = keys[t]
        count_and_link(lists, key, previous_key)
        window = keys[t:]
        same = window
        out[key] += same[0] * lists[1][key] + lists[2][0]
        previous_key = key
    out += lists[0]


def test_a_kernel_compiled_with_the_pass_computes_what_its_python_computes(monkeypatch):
    import numba

    from moe_offload.simulator.kernels import HELPER_OPTIONS

    namespace = dict(link_all.__globals__)
    namespace["lists_of"] = numba.njit(**HELPER_OPTIONS)(lists_of)
    namespace["count_and_link"] = numba.njit(**HELPER_OPTIONS)(count_and_link)
    linked = type(link_all)(link_all.__code__, namespace, "link_all")
    found = []
    monkeypatch.setattr(compiled, "forward_copies", lambda func_ir: found.append(forward_copies(func_ir)) or found[-1])
    function = compile_uncached(linked, "void(int64[::1], int64[::1])")
    keys = np.random.default_rng(0).integers(0, 16, 500).astype(np.int64)
    expected, got = np.zeros(16, np.int64), np.zeros(16, np.int64)
    link_all(keys, expected)
    function(keys, got)
    np.testing.assert_array_equal(got, expected)
    # the helper's parameter and the arrays it unpacks from it were forwarded; the copy made in the loop was not
    forwarded = {name.rsplit("_", 1)[-1] for name in found[0] if "count_and_link" in name}
    assert {"lists", "following", "counts", "ends"} <= forwarded
    assert "same" not in found[0]


def test_without_the_pass_functions_compile_as_numba_compiles_them(monkeypatch):
    """Where this Numba lacks what the pass is built on (``pipeline_with_forward_copies`` gives None), njit_cached
    compiles with Numba's own pipeline: slower, the same results."""
    import numba

    asked = []
    real_njit = numba.njit

    def njit(*args, **options):  # what njit_cached asks of Numba, compiled without the on-disk cache
        asked.append(options)
        options.pop("cache", None)
        return real_njit(*args, **options)

    monkeypatch.setattr(compiled, "pipeline_with_forward_copies", lambda: None)
    monkeypatch.setattr(numba, "njit", njit)
    function = compiled.njit_cached(copies_and_items, "int64(int64[::1], int64)")
    keys = np.arange(9, dtype=np.int64)
    assert function(keys, 4) == copies_and_items(keys, 4)
    assert asked and "pipeline_class" not in asked[0]
