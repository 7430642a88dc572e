"""A grid of replays: every policy at every cache size, each reported against Belady's OPT at the same size.

The runs are independent: the compiled kernels run on threads of this process (they release the GIL, and read
the one request sequence with nothing copied), the Python policies in worker processes forked with the input
once; results do not depend on how they are spread.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Callable, Iterable

from moe_offload.errors import ConfigError
from moe_offload.policies import ModelSpec, make_policy, policy_info
from moe_offload.results import RunResult
from moe_offload.simulator.replay import ReplayInput, check_cache_size, replay, replay_kernel, run_notes
from moe_offload.values import integer, worker_count


@dataclass
class GridResult:
    results: list[RunResult]
    skipped: list[tuple[str, int, str]]  # (policy, cache size, reason) of the runs that cannot be made


_GRID_DATA: ReplayInput | None = None  # the input of the worker processes, set once per process


def _init_worker(data: ReplayInput) -> None:
    global _GRID_DATA
    _GRID_DATA = data


def _run_task(task) -> RunResult:
    """A task in a worker process, on the input its initializer set."""
    return _replay_task(_GRID_DATA, task)


def _replay_task(data: ReplayInput, task) -> RunResult:
    policy, size, seed, options, engine = task
    return replay(data, policy, size, seed=seed, options=options, engine=engine)


def grid_runs(spec: ModelSpec, policies: list[str], cache_sizes: list[int]):
    """The (policy, size) runs of a grid, Belady first at every size (every run is reported against it), and
    the (policy, size, reason) of those that cannot run: a -dist policy with fewer slots than layers. Any other
    problem raises ConfigError."""
    for policy in policies:
        policy_info(policy)
    for size in cache_sizes:
        check_cache_size("belady", size, spec)
    runs, skipped = [], []
    for size in cache_sizes:
        runs.append(("belady", size))
        for policy in policies:
            if policy == "belady":
                continue
            try:
                check_cache_size(policy, size, spec)
            except ConfigError as exc:
                skipped.append((policy, size, str(exc)))
                continue
            runs.append((policy, size))
    return runs, skipped


def replay_grid(data: ReplayInput, policies: Iterable[str], cache_sizes: Iterable[int], *, seed: int = 0,
                options: dict[str, dict] | None = None, jobs: int = 1,
                progress: Callable[[int], None] | None = None, engine: str = "auto",
                reference: RunResult | None = None) -> GridResult:
    """Every policy at every cache size, each reported against Belady OPT at the same size (``reference``:
    Belady's result at the one size of the grid, already replayed, in place of a run of it).

    Runs are independent, so ``jobs`` > 1 spreads them: the compiled ones over threads of this process (their
    kernels release the GIL), the Python ones over worker processes; results do not depend on it, nor on
    ``engine`` (see ``replay``). Belady's runs, when only the reference of the others (not asked for), are not
    counted in ``jobs``: one more thread runs them beside the policies' (a run of one policy at one size
    with --jobs 1 takes the time of the slower of the two, not of both). A (policy, size) pair that cannot run
    (a -dist policy with fewer slots than layers) is skipped with its reason; any other problem raises
    ConfigError before the first run. A policy that replays as another of the grid (``replays_as``) takes that
    run's result."""
    policies = list(dict.fromkeys(policies))
    cache_sizes = sorted({integer(size, "cache_size", low=1) for size in cache_sizes})
    made = {policy: make_policy(policy, data.spec, seed=seed, options=(options or {}).get(policy))
            for policy in policies}  # every policy and its options are checked before the first run
    runs, skipped = grid_runs(data.spec, policies, cache_sizes)
    if reference is not None:
        if cache_sizes != [reference.cache_size]:
            raise ValueError("a grid given Belady's result runs at its size only")
        runs = [run for run in runs if run[0] != "belady"]
    # a run whose policy replays as another of the grid at its size, neither given options, takes that run's result
    index_of = {run: index for index, run in enumerate(runs)}
    twins = {}
    for index, (policy, size) in enumerate(runs):
        twin = made[policy].replays_as(data.trace) if policy in made else None
        if (twin, size) in index_of and not (options or {}).get(policy) and not (options or {}).get(twin):
            twins[index] = index_of[(twin, size)]
    for policy in dict.fromkeys(policy for policy, _ in runs):
        replay_kernel(policy, engine)  # compiled now, once: the threads share it, worker processes inherit it
    if any(replay_kernel(policy, engine) is None or not policy_info(policy).partitioned for policy, _ in runs):
        data.sequence  # flattened here, once, before any thread or worker process reads it (-dist kernels do not)
    tasks = [(policy, size, seed, (options or {}).get(policy), engine) for policy, size in runs]

    compiled = [replay_kernel(policy, engine) is not None for policy, _ in runs]
    done: list[RunResult | None] = [None] * len(tasks)

    def finished(index: int, result: RunResult) -> None:
        done[index] = result
        if progress is not None:
            progress(result.accesses)

    slow = [index for index, fast in enumerate(compiled) if not fast and index not in twins]
    # the costliest kernels first: a long run started last would finish alone (base.py ``replay_cost``)
    fast = sorted((index for index, fast in enumerate(compiled) if fast and index not in twins),
                  key=lambda index: -policy_info(runs[index][0]).policy.replay_cost)
    processes = None
    if worker_count(jobs, len(slow)) > 1:  # the Python policies hold the GIL: worker processes, each with the
        # input once, forked here, before any thread of this call runs
        context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
        processes = ProcessPoolExecutor(max_workers=worker_count(jobs, len(slow)), mp_context=context,
                                        initializer=_init_worker, initargs=(data,))
        slow_results = processes.map(_run_task, [tasks[index] for index in slow])
    # the compiled kernels release the GIL: threads of this process run them side by side on the one request
    # sequence, with nothing to copy (simulator/kernels.py); each run makes the columns its kernel reads on its
    # own thread (next uses for Belady's beside another policy's run), or waits for them (AccessSequence)
    references = sum(1 for index in fast if runs[index][0] == "belady" and "belady" not in policies)
    threads_wanted = worker_count(jobs, max(1, len(fast) - references)) + (1 if references else 0)
    with ThreadPoolExecutor(max_workers=threads_wanted) as threads:
        # the input passed, not the workers' global: grids may run at once on threads (reporting/bound.py)
        futures = {threads.submit(_replay_task, data, tasks[index]): index for index in fast}
        if processes is not None:
            with processes:
                for index, result in zip(slow, slow_results):
                    finished(index, result)
        else:
            for index in slow:
                finished(index, _replay_task(data, tasks[index]))
        for future in as_completed(futures):
            finished(futures[future], future.result())
    for index, twin in twins.items():
        policy = runs[index][0]
        finished(index, replace(done[twin], policy=policy, notes=run_notes(policy, data, done[twin].in_hindsight)))

    set_opt_misses(done + ([reference] if reference is not None else []))
    results = [result for result in done if result.policy != "belady" or "belady" in policies]
    return GridResult(results=results, skipped=skipped)


def set_opt_misses(results: list[RunResult]) -> None:
    """Fill ``opt_misses`` of replay results from the Belady result of the same trace and cache size among them."""
    opt = {(r.trace, r.cache_size): r.misses for r in results if r.policy == "belady"}
    for result in results:
        result.opt_misses = opt.get((result.trace, result.cache_size))
