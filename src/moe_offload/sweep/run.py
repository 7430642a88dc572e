"""Running a sweep's cells: in this process, in worker processes, or as Ray tasks; results into the store.

A cell runs the way `simulate` runs the same configuration (``replay`` or ``simulate_timed`` with the same
arguments), so a sweep's row and simulate's result agree, and no backend changes a result. What the cells
read (traces, hardware profiles, the history) is a ``Workload`` sent once: to forked worker processes as
they start, to Ray's object store once per sweep, whence each task reads it without copying the arrays; each
worker flattens a trace once for all the replay cells it runs on it.

Ray is asked for only with ``ray_address``: "local" starts a Ray on this machine for the sweep (``jobs``
CPUs, no dashboard, an object store sized to the workload, shut down at the end), "auto" joins the cluster
this machine belongs to, anything else is the address of a cluster to join (its nodes need moe-offload
installed). Whatever the backend, each finished cell goes to the ResultStore as it arrives, and the store is
written when the sweep ends, fails or is interrupted.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Callable

from moe_offload.errors import ConfigError, MoeOffloadError
from moe_offload.hardware.profile import HardwareProfile
from moe_offload.results import RunResult
from moe_offload.simulator.replay import ReplayInput, replay, replay_kernel
from moe_offload.simulator.timed import ALL_RESIDENT, Arrivals, simulate_timed
from moe_offload.sweep.spec import Cell, Sweep
from moe_offload.sweep.store import ResultStore, Row
from moe_offload.trace.format import Trace

RAY_HINT = "--ray needs Ray: pip install 'moe-offload[ray]'"
RAY_MIN_OBJECT_STORE = 128 * 2**20


@dataclass
class Workload:
    """What the cells of one sweep read (module doc)."""

    traces: dict[str, Trace]
    hardware: dict[str, HardwareProfile]
    history: Trace | None
    engine: str
    token: str = field(default_factory=lambda: uuid.uuid4().hex)  # tells one sweep's workload from another's

    @classmethod
    def of(cls, sweep: Sweep) -> "Workload":
        timed = sweep.timed
        return cls(traces=sweep.traces, hardware=timed.hardware if timed else {},
                   history=timed.history if timed else None, engine=sweep.engine)

    @property
    def nbytes(self) -> int:
        traces = list(self.traces.values()) + ([self.history] if self.history is not None else [])
        return sum(value.nbytes for trace in traces for value in vars(trace).values() if hasattr(value, "nbytes"))


_FLATTENED: dict[tuple[str, str], ReplayInput] = {}  # (workload token, trace) -> its flattened requests


def run_cell(workload: Workload, cell: Cell) -> RunResult:
    """The result of one cell, as `simulate` would compute it."""
    options = json.loads(cell.options)
    if cell.mode == "replay":
        key = (workload.token, cell.trace)
        if key not in _FLATTENED:
            if any(token != workload.token for token, _ in _FLATTENED):
                _FLATTENED.clear()  # another sweep's traces are not needed any more
            _FLATTENED[key] = ReplayInput.of(workload.traces[cell.trace], name=cell.trace)
        seed = 0 if cell.seed is None else cell.seed  # None: the policy draws nothing from it
        return replay(_FLATTENED[key], cell.policy, cell.cache_size, seed=seed, options=options.get("policy"),
                      engine=workload.engine)
    trace, hardware = workload.traces[cell.trace], workload.hardware[cell.hardware]
    arrivals = Arrivals.parse(options["arrivals"], options["max_batch"], cell.seed)
    if cell.policy == ALL_RESIDENT:
        return simulate_timed(trace, hardware, expert_bytes=options["expert_bytes"], arrivals=arrivals, seed=cell.seed,
                              name=cell.trace, all_resident=True)
    return simulate_timed(trace, hardware, cell.policy, cell.cache_size, expert_bytes=options["expert_bytes"],
                          prefetcher=cell.prefetcher, prefetcher_options=options.get("prefetcher"),
                          history=workload.history, arrivals=arrivals, seed=cell.seed,
                          policy_options=options.get("policy"), name=cell.trace)


def run_cells(sweep: Sweep, cells: list[Cell], store: ResultStore, *, jobs: int = 1, ray_address: str | None = None,
              progress: Callable[[], None] | None = None) -> None:
    """Run ``cells`` of ``sweep``, each result into ``store`` as it finishes; the store is written at the end,
    also when a cell fails or the sweep is interrupted."""
    workload = Workload.of(sweep)
    for policy in dict.fromkeys(cell.policy for cell in cells if cell.mode == "replay"):
        replay_kernel(policy, sweep.engine)  # compiled (or loaded) once, here: workers inherit it or find it cached

    def finished(cell: Cell, result: RunResult) -> None:
        store.add(Row(cell, result))
        if progress is not None:
            progress()

    try:
        if ray_address is not None:
            _run_on_ray(workload, cells, finished, jobs, ray_address)
        elif jobs > 1 and len(cells) > 1:
            _run_in_processes(workload, cells, finished, jobs)
        else:
            for cell in cells:
                finished(cell, run_cell(workload, cell))
    finally:
        store.write()


_WORKLOAD: Workload | None = None  # the workload of a worker process, set once as it starts


def _init_worker(workload: Workload) -> None:
    global _WORKLOAD
    _WORKLOAD = workload


def _process_task(cell: Cell) -> RunResult:
    return run_cell(_WORKLOAD, cell)


def _run_in_processes(workload: Workload, cells: list[Cell], finished, jobs: int) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_init_worker, initargs=(workload,))
    try:
        futures = {pool.submit(_process_task, cell): cell for cell in cells}
        for future in as_completed(futures):
            finished(futures[future], future.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def _ray_task(workload: Workload, cell: Cell) -> RunResult:
    return run_cell(workload, cell)


def _run_on_ray(workload: Workload, cells: list[Cell], finished, jobs: int, address: str) -> None:
    if not ray_available():
        raise ConfigError(RAY_HINT)
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        _start_ray(address, jobs, workload.nbytes)
    try:
        task = ray.remote(num_cpus=1)(_ray_task)
        shared = ray.put(workload)
        pending = {task.remote(shared, cell): cell for cell in cells}
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    cell = pending.pop(ref)
                    try:
                        result = ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:
                        if isinstance(exc.cause, MoeOffloadError):
                            raise exc.cause from None
                        raise
                    finished(cell, result)
        finally:
            for ref in pending:
                ray.cancel(ref)
    finally:
        if started_here:
            ray.shutdown()


def _start_ray(address: str, jobs: int, workload_bytes: int) -> None:
    import ray

    if address == "local":
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a local sweep reports nothing anywhere
        ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR,
                 object_store_memory=max(RAY_MIN_OBJECT_STORE, 4 * workload_bytes))
        return
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"--ray {address}: cannot join a Ray cluster there ({exc}); `ray start --head` starts "
                          "one, --ray local runs the sweep on a Ray of its own") from None
