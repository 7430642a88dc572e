"""Keeping PyTorch's OpenMP teams to the one thread that computes the forward passes.

PyTorch (built with OpenMP, as its CPU wheels are) runs an operation over more elements than its grain
(at::internal::GRAIN_SIZE, 32,768) as an OpenMP parallel region, and OpenMP gives each thread that starts
one a team of its own, whose workers stay for the life of the process. The engine has several threads: the
one that loads the model, the readers and link workers that convert experts, the batching scheduler. Once
their teams together hold more threads than the machine has cores, OpenMP lets idle workers sleep at once
instead of spinning (libgomp's throttled spin count), and every parallel operation of the computing thread
then pays for waking its team.

Measured on this 2-core machine: a plain transformers generate in the same process took 2.2 times as long
as soon as the engine had converted its first expert, and was as fast again once the engine closed; the
batching scheduler served 16 requests 3.8 times slower when the thread that had loaded the model held a
team. So every copy outside the computing thread stays on its thread (``copy_serially``: the readers and
workers already run concurrently, a team gains them nothing), and the engine loads with one thread
(``single_threaded``), and every forward pass of the engine, ``generate``'s included, runs on one thread,
the batching scheduler's (runtime/batching.py), which so holds the only team. (An engine that replays a
trace has no scheduler: it computes on the caller's thread.) Code of the caller's own that computes with
PyTorch on another thread still makes a second team.

**The computing thread sets its count itself.** ``torch.set_num_threads`` also sets the count a thread takes
when it first runs a parallel operation, so a new thread that starts while a worker is inside
:func:`single_threaded` (or after one restored a count it took there) computes with one thread for the rest
of its life. A matrix product's bits depend on the thread count (ATen's float32 ``linear`` of 5 rows gives
other bits on one thread than on two), so the engine takes the caller's count when it is built
(:func:`computing_threads`) and the scheduler's thread sets it before its first operation
(:func:`set_thread_count`): a run gives the same bits whatever the workers were doing when the scheduler
started. Setting the count is not enough by itself: PyTorch gives a thread, at its first parallel operation
or its first question of its count, the count that any thread set last, even over a count the thread set
for itself before. A worker that entered :func:`single_threaded` between the scheduler's setting and its
first operation so left it on one thread, and other bits (seen as one run in five of the on-arrival tests on
a loaded machine); the thread asks first, then sets.
"""

from __future__ import annotations

from contextlib import contextmanager

SERIAL_ELEMENTS = 31 * 1024  # under PyTorch's grain of 32,768 elements: the copy stays on its thread


def copy_serially(destination, source) -> None:
    """``destination.copy_(source)`` for CPU tensors of one shape, in blocks along the first dimension that
    PyTorch copies on the calling thread alone (a single row longer than the grain still starts a team).
    Between float16 and bfloat16 each block goes through float32, which gives the direct conversion's bits
    three times as fast (models/host_experts.py compute_ready says why)."""
    import torch

    row = source[0].numel() if source.dim() > 1 and source.shape[0] else 1
    step = max(1, SERIAL_ELEMENTS // max(row, 1))
    widen = {source.dtype, destination.dtype} == {torch.float16, torch.bfloat16}
    for start in range(0, source.shape[0], step):
        block = source[start:start + step]
        destination[start:start + step].copy_(block.float() if widen else block)


def computing_threads() -> int:
    """The calling thread's PyTorch thread count: what the engine's computing thread is given."""
    import torch

    return torch.get_num_threads()


def set_thread_count(count: int) -> None:
    """The calling thread computes with ``count`` threads from now on, whatever other threads set later."""
    import torch

    torch.get_num_threads()  # PyTorch's one-time setting of this thread's count, done now (module docstring)
    torch.set_num_threads(count)


@contextmanager
def single_threaded():
    """Within the block, PyTorch runs the calling thread's operations without an OpenMP team (its thread count
    is 1, then as it was: PyTorch keeps the count per thread once a thread has used it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
