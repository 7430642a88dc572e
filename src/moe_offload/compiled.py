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

One pass more than Numba's own (``forward_copies``). Numba counts references to arrays: a variable that
takes an array from another (``a = b``) takes a reference, released where it dies, each an atomic operation
on the array's counter. Inlining a helper binds each parameter so (``previous = lists``), and unpacks a
tuple of arrays so (``previous, following, ends = lists``), at every call: in a kernel's loop that was two
atomic operations per array per helper call, which Numba's pruning of reference pairs leaves where the
helper branches. The pass, after Numba rebuilds single assignments, makes every use of such a variable a
use of the variable it always equals, when that one is assigned once and outside every loop (so it holds
one value for the whole call: the kernel's arguments, the arrays it makes before its loop, the items of a
tuple built there), and drops the copy. The replay kernels' linked-list helpers then cost what the same code
written out in the loop costs, with the same decisions: the machine code differs in its reference counting
only (docs/benchmarks.md, "Replay throughput", has the kernels' rates with and without the pass).

One helper has a compiled twin (``compiled_twin``): ``highest_bit``, whose plain Python (an integer's bit
length) Numba cannot compile; a compiled kernel calls Numba's count of leading zeros, one instruction, in its
place.
"""

from __future__ import annotations

import functools

import numpy as np

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

    pipeline = pipeline_with_forward_copies()
    options = {"pipeline_class": pipeline} if pipeline is not None else {}
    try:
        return numba.njit(signature, cache=True, nogil=True, **options)(function)
    except RuntimeError as exc:  # no folder to cache in (read-only install, no writable home)
        if "cannot cache" not in str(exc):
            raise
        return numba.njit(signature, nogil=True, **options)(function)


PIPELINE = "forward_copies 1"  # in the replay kernels' digest (simulator/kernels.py): a change is a new cache entry


@functools.cache
def pipeline_with_forward_copies():
    """Numba's nopython pipeline with the pass ``forward_copies`` after its single-assignment form (module doc);
    None where this Numba's compiler lacks what the pass is built on (its internals, which a release may move):
    the functions then compile as Numba compiles them, slower, with the same results."""
    try:
        from numba.core import ir, ir_utils, postproc
        from numba.core.compiler import CompilerBase, DefaultPassBuilder
        from numba.core.compiler_machinery import FunctionPass, register_pass
        from numba.core.untyped_passes import ReconstructSSA
    except ImportError:
        return None

    @register_pass(mutates_CFG=False, analysis_only=False)
    class ForwardCopies(FunctionPass):
        _name = "forward_copies"

        def __init__(self):
            FunctionPass.__init__(self)

        def run_pass(self, state):
            func_ir = state.func_ir
            # Numba's IR is its internals, which a release may change: where the analysis fails, no copy is
            # forwarded and the function compiles as Numba compiles it (tests/test_compiled.py then fails)
            try:
                mapping = forward_copies(func_ir)
            except Exception:
                return False
            if not mapping:
                return False
            for block in func_ir.blocks.values():
                block.body = [statement for statement in block.body
                              if not (isinstance(statement, ir.Assign) and statement.target.name in mapping)]
            ir_utils.replace_vars(func_ir.blocks, mapping)
            func_ir._definitions = ir_utils.build_definitions(func_ir.blocks)
            postproc.PostProcessor(func_ir).run()
            return True

    class PipelineWithForwardCopies(CompilerBase):
        def define_pipelines(self):
            passes = DefaultPassBuilder.define_nopython_pipeline(self.state)
            try:
                passes.add_pass_after(ForwardCopies, ReconstructSSA)
            except ValueError:  # a pipeline without the single-assignment form the pass reads: Numba's own
                pass
            passes.finalize()
            return [passes]

    return PipelineWithForwardCopies


def forward_copies(func_ir) -> dict:
    """{name: variable} for each variable of Numba's ``func_ir`` assigned once from another variable, or from an
    item of a tuple, that always equals a variable assigned once outside every loop: that variable (module
    doc)."""
    from numba.core import ir, ir_utils
    from numba.core.analysis import compute_cfg_from_blocks

    blocks = func_ir.blocks
    definitions = ir_utils.build_definitions(blocks)
    in_loop = set()
    for loop in compute_cfg_from_blocks(blocks).loops().values():
        in_loop |= set(loop.body)
    value_of, target_of, once_outside_loops = {}, {}, set()
    for label, block in blocks.items():
        for statement in block.body:
            if isinstance(statement, ir.Assign) and len(definitions[statement.target.name]) == 1:
                value_of[statement.target.name] = statement.value
                target_of[statement.target.name] = statement.target
                if label not in in_loop:
                    once_outside_loops.add(statement.target.name)

    def source(variable, depth=0):
        """The variable whose value ``variable`` always holds: through copies and items of built tuples."""
        while depth < 64:  # a chain of inlined helpers is a few links long; 64 also ends a cycle of dead code
            depth += 1
            value = value_of.get(variable.name)
            if isinstance(value, ir.Var):
                variable = value
            elif isinstance(value, ir.Expr) and value.op == "static_getitem" and isinstance(value.index, int):
                items = tuple_items(value.value, depth)
                if items is None or not 0 <= value.index < len(items):
                    return variable
                variable = items[value.index]
            else:
                return variable
        return variable

    def tuple_items(variable, depth):
        """The items of the tuple built once outside every loop that ``variable`` always holds, or None."""
        while depth < 64:
            depth += 1
            variable = source(variable, depth)
            value = value_of.get(variable.name)
            if isinstance(value, ir.Expr) and value.op == "exhaust_iter":  # a tuple's unpacking
                variable = value.value
            elif isinstance(value, ir.Expr) and value.op == "build_tuple" and variable.name in once_outside_loops:
                return value.items
            else:
                return None
        return None

    mapping = {}
    for name, value in value_of.items():
        if isinstance(value, ir.Var) or (isinstance(value, ir.Expr) and value.op == "static_getitem"):
            root = source(target_of[name])
            if root.name != name and root.name in once_outside_loops:
                mapping[name] = root
    return mapping


def highest_bit(word) -> int:
    """The index of the highest set bit of ``word``, a nonzero unsigned 64-bit integer: its bit length less one
    (compiled, ``compiled_twin``'s count of leading zeros)."""
    return int(word).bit_length() - 1


def highest_bit_by_halving(word) -> int:
    """``highest_bit`` in arithmetic Numba compiles: six halvings of the part still to search."""
    index = 0
    for shift in (32, 16, 8, 4, 2, 1):
        if word >> np.uint64(shift):
            word >>= np.uint64(shift)
            index += shift
    return index


@functools.cache
def compiled_twin(function):
    """The Numba function a compiled kernel calls in place of ``function`` (module doc), or None: every helper
    but ``highest_bit`` is compiled from its own code. Numba's count of leading zeros is one of its internal
    intrinsics; where a release has moved it, ``highest_bit_by_halving`` takes its place."""
    if function is not highest_bit:
        return None
    import numba  # an optional dependency (module docstring)

    try:
        from numba.cpython.unsafe.numbers import leading_zeros
    except ImportError:
        return numba.njit(inline="always")(highest_bit_by_halving)

    def highest_bit_compiled(word):
        return 63 - np.int64(leading_zeros(word))
    return numba.njit(inline="always")(highest_bit_compiled)
