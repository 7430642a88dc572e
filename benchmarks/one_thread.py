"""Batching after a ``generate``: does the engine still compute on one thread?

    python benchmarks/one_thread.py [--rounds 3] [--threads N]

PyTorch gives every thread that runs a parallel operation an OpenMP team of its own, and with more OpenMP
threads than cores every operation waits for its team to wake (runtime/cpu_threads.py). An engine computes
every forward pass on one thread, its batching scheduler's, ``generate`` included (runtime/batching.py). This
times 16 prompts x 24 tokens through ``generate_batch`` (fast batch math, 100% budget) on a fresh engine, and
on a fresh engine after one ``generate``, each in a process of its own, ``--rounds`` times in turn, the best
of each: with one computing thread the two match (365 and 381 ms, 493 and 400 ms in two runs on this 2-core
machine); with ``generate`` on the caller's thread (the runtime before that change, commit fd67ea1) the
second took 1368 ms against 389 ms.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor


def batch_seconds(case: str, threads: int | None) -> float:
    """In a fresh process (the OpenMP teams of one case must not outlive it): one engine, one ``generate``
    first for "after one generate", a warm-up batch, then the best of two timed batches."""
    import torch

    from batch_invariance import PROMPTS

    from moe_offload.api import load

    if threads is not None:
        torch.set_num_threads(threads)
    with load("tiny", fast_budget="100%", policy="lru", max_batch=len(PROMPTS), batch_math="fast") as engine:
        if case == "after one generate":
            engine.generate(PROMPTS[0], max_new_tokens=4)
        engine.generate_batch(PROMPTS, max_new_tokens=4)
        best = float("inf")
        for _ in range(2):
            started = time.perf_counter()
            engine.generate_batch(PROMPTS, max_new_tokens=24)
            best = min(best, time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", default="3")
    parser.add_argument("--threads", default=None, help="PyTorch's CPU threads (default: PyTorch's, one per core)")
    args = parser.parse_args(argv)

    from moe_offload import values

    rounds = values.integer(args.rounds, "--rounds", low=1)
    threads = None if args.threads is None else values.integer(args.threads, "--threads", low=1, high=values.cores())
    cases = ("batch only", "after one generate")
    seconds = {case: float("inf") for case in cases}
    for _ in range(rounds):  # the cases in turn, so that a slow minute does not land on one only
        for case in cases:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as process:
                seconds[case] = min(seconds[case], process.submit(batch_seconds, case, threads).result())
    for case in cases:
        print(f"{case:>18}: {seconds[case] * 1000:7.0f} ms for 16 prompts x 24 tokens (best of {rounds} processes)")
    print(f"after one generate / batch only: {seconds['after one generate'] / seconds['batch only']:.2f}x")
    return 0


if __name__ == "__main__":
    from script import run

    run(main)
