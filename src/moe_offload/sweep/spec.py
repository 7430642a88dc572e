"""A sweep file (TOML, docs/sweep-format.md) read, checked and expanded into cells, before any work.

Every problem is a ConfigError of one line naming the file and the key: a key the format does not have, a
value of the wrong type, an unknown policy, prefetcher, hardware profile or trace, a cache size that is none,
options a policy or prefetcher does not take, a timed run the hardware cannot make. Traces and profiles are
read here, once, so a sweep that starts has everything it needs.

A cell is one run: (mode, trace, policy, cache size, prefetcher, hardware, seed, options). Cache sizes are
resolved per trace, in experts for the replay and in bytes for the timed simulation, so "25%" and the
number of experts it gives are the same cell. ``options`` is the canonical JSON of everything else that
changes the run's result: the policy's and the prefetcher's options and, for a timed cell, the arrivals,
the batch size, the history and the expert size. A cell's ``key`` (its fields as canonical JSON) is what a
results file records to know that the cell is done.

A replay cell of a policy that draws no random number (every policy but the ``seeded`` ones: random, marking,
LeCaR) gives the same result whatever the seed, so it is run once, with seed None, and stands for every seed;
a timed cell keeps its seed (Poisson arrivals draw from it).
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moe_offload.bundled import BUNDLED_TRACES
from moe_offload.errors import ConfigError, MoeOffloadError
from moe_offload.hardware import resolve_profile
from moe_offload.hardware.profile import HardwareProfile, preset_names
from moe_offload.policies import ModelSpec, default_policies, policy_info
from moe_offload.prefetch import check_trace_columns, make_prefetcher, prefetcher_info
from moe_offload.simulator.grid import grid_runs
from moe_offload.simulator.replay import ENGINES
from moe_offload.simulator.timed import ALL_RESIDENT, ORACLE, Arrivals, check_timed_run
from moe_offload.simulator.timed.simulate import timed_runs
from moe_offload.trace.format import Trace, read_trace
from moe_offload.values import parse_bytes

MODES = ("replay", "timed")
TOP_LEVEL = {"output", "traces", "policies", "cache_sizes", "modes", "seeds", "engine", "policy_options", "timed"}
TIMED_KEYS = {"hardware", "prefetchers", "history", "arrivals", "max_batch", "expert_bytes", "prefetch_options"}
DEFAULT_HARDWARE = "desktop-rtx4090"


@dataclass(frozen=True)
class Cell:
    """One run of a sweep (module doc). ``cache_size`` is in experts for the replay, bytes for the timed
    simulation, None for the all-resident bound; ``hardware`` and ``trace`` are as the sweep file names them."""

    mode: str
    trace: str
    policy: str
    cache_size: int | None
    prefetcher: str | None
    hardware: str | None
    seed: int | None  # None: a replay that draws no random number, the same at every seed (module doc)
    options: str  # canonical JSON

    @property
    def key(self) -> str:
        return canonical(asdict(self))

    @classmethod
    def from_key(cls, key: str) -> "Cell":
        return cls(**json.loads(key))


def canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@dataclass
class TimedSettings:
    hardware: dict[str, HardwareProfile]  # as named in the file -> profile
    prefetchers: list[str | None]
    prefetch_options: dict[str, dict]
    history_name: str | None
    history: Trace | None
    arrivals: str
    max_batch: int
    expert_bytes: int | None  # None: each trace's metadata


@dataclass
class Sweep:
    """A checked sweep: its inputs, read, and its cells in order (replay before timed, Belady before the
    policies it is compared with, each timed all-resident bound before the runs measured against it)."""

    path: Path
    output: Path
    traces: dict[str, Trace]  # as named in the file -> trace
    policies: list[str]       # as asked for (the replay adds Belady, the reference)
    engine: str
    policy_options: dict[str, dict]
    timed: TimedSettings | None
    seeds: list[int] = field(default_factory=lambda: [0])
    cells: list[Cell] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # cells that cannot run, with the reason


def read_sweep(path, output=None) -> Sweep:
    """Read and check the sweep file ``path``; ``output`` overrides its ``output`` key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such sweep file")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not a valid TOML sweep file ({exc})") from None
    check = _Checker(path)
    check.known(raw, TOP_LEVEL, "")
    for key in ("traces", "policies", "cache_sizes"):
        if key not in raw:
            raise ConfigError(f"{path}: {key}: missing (docs/sweep-format.md)")

    modes = check.names(raw.get("modes", ["replay"]), "modes")
    for mode in modes:
        if mode not in MODES:
            raise ConfigError(f"{path}: modes: {mode!r} is neither replay nor timed")
    seeds = check.list_of(raw.get("seeds", [0]), "seeds", int, "integers")
    engine = raw.get("engine", "auto")
    if engine not in ENGINES:
        raise ConfigError(f"{path}: engine: {engine!r} is not one of {', '.join(ENGINES)}")
    policies = default_policies() if raw["policies"] == "all" else check.names(raw["policies"], "policies", '"all" or ')
    for policy in policies:
        check.wrap(lambda: policy_info(policy), "policies")
    traces = {}
    for name in check.names(raw["traces"], "traces"):
        traces[name] = check.wrap(lambda: read_trace(_trace_file(path, name)), "traces")
    first = next(iter(traces.values())).meta  # options are checked on the first trace's model
    spec = ModelSpec(first.num_layers, first.num_experts, first.top_k)
    policy_options = check.options(raw.get("policy_options", {}), "policy_options", policy_info)
    for name, options in policy_options.items():
        check.wrap(lambda: _build_policy(name, spec, options), f"policy_options.{name}")
    output = Path(output) if output is not None else _relative(path, check.string(
        raw.get("output", path.with_suffix(".parquet").name), "output"))

    timed = None
    if "timed" in modes:
        timed = _timed_settings(check, raw.get("timed", {}), traces, spec)
    elif "timed" in raw:
        raise ConfigError(f"{path}: timed: applies only when modes includes \"timed\"")
    sweep = Sweep(path=path, output=output, traces=traces, policies=policies, engine=engine,
                  policy_options=policy_options, timed=timed, seeds=seeds)
    sizes = check.list_of(raw["cache_sizes"], "cache_sizes", (int, float, str), "sizes")
    if "replay" in modes:
        _replay_cells(sweep, check, policies, sizes, seeds)
    if timed is not None:
        _timed_cells(sweep, check, policies, sizes, seeds)
    return sweep


def _relative(sweep_file: Path, name: str) -> Path:
    """A file named in the sweep file: relative to its folder unless absolute."""
    return sweep_file.parent / name  # an absolute name replaces the folder


def _trace_file(sweep_file: Path, name: str) -> Path:
    """A bundled trace's name (unless a file of that name is beside the sweep file), else a file."""
    candidate = _relative(sweep_file, name)
    if name in BUNDLED_TRACES and not candidate.exists():
        return BUNDLED_TRACES[name]
    return candidate


def _profile(sweep_file: Path, name: str) -> HardwareProfile:
    """A hardware preset by name, else a profile file (a name with a folder or ending in .toml)."""
    if name in preset_names() or ("/" not in name and not name.endswith(".toml")):
        return resolve_profile(name)  # a preset, or the error that names the presets
    return resolve_profile(str(_relative(sweep_file, name)))


def _build_policy(name: str, spec: ModelSpec, options: dict):
    try:
        return policy_info(name).policy(spec, seed=0, **options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _timed_settings(check: "_Checker", raw, traces: dict[str, Trace], spec: ModelSpec) -> TimedSettings:
    if not isinstance(raw, dict):
        raise ConfigError(f"{check.path}: timed: must be a table")
    check.known(raw, TIMED_KEYS, "timed.")
    hardware = {name: check.wrap(lambda: _profile(check.path, name), "timed.hardware")
                for name in check.names(raw.get("hardware", [DEFAULT_HARDWARE]), "timed.hardware")}
    prefetchers = []
    for name in check.names(raw.get("prefetchers", ["none"]), "timed.prefetchers"):
        if name != "none":
            check.wrap(lambda: prefetcher_info(name), "timed.prefetchers")
        prefetchers.append(None if name == "none" else name)
    prefetch_options = check.options(raw.get("prefetch_options", {}), "timed.prefetch_options", prefetcher_info)
    for name, options in prefetch_options.items():
        check.wrap(lambda: make_prefetcher(name, spec, options), f"timed.prefetch_options.{name}")
    for trace_name, trace in traces.items():
        for name in [p for p in prefetchers if p is not None] + [ORACLE]:
            check.wrap(lambda: check_trace_columns(prefetcher_info(name), trace), "timed.prefetchers")
    history_name = raw.get("history")
    history = None
    if history_name is not None:
        history = check.wrap(lambda: read_trace(_trace_file(check.path, check.string(history_name, "timed.history"))),
                             "timed.history")
    arrivals = check.string(raw.get("arrivals", "trace"), "timed.arrivals")
    max_batch = raw.get("max_batch", 8)
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise ConfigError(f"{check.path}: timed.max_batch: {max_batch!r} is not a positive integer")
    check.wrap(lambda: Arrivals.parse(arrivals, max_batch, 0), "timed.arrivals")
    expert_bytes = raw.get("expert_bytes")
    if expert_bytes is not None:
        expert_bytes = check.wrap(lambda: parse_bytes(expert_bytes, "expert_bytes"), "timed.expert_bytes")
    else:
        for trace_name, trace in traces.items():
            if not trace.meta.expert_bytes:
                raise ConfigError(f"{check.path}: timed.expert_bytes: trace {trace_name} gives no expert size; "
                                  "set it")
    return TimedSettings(hardware=hardware, prefetchers=list(dict.fromkeys(prefetchers)),
                         prefetch_options=prefetch_options, history_name=history_name, history=history,
                         arrivals=arrivals, max_batch=max_batch, expert_bytes=expert_bytes)


def _replay_cells(sweep: Sweep, check: "_Checker", policies: list[str], sizes: list, seeds: list[int]) -> None:
    for trace_name, trace in sweep.traces.items():
        meta = trace.meta
        spec = ModelSpec(meta.num_layers, meta.num_experts, meta.top_k)
        experts = sorted({check.experts(size, meta, trace_name) for size in sizes})
        runs, skipped = check.wrap(lambda: grid_runs(spec, policies, experts), "cache_sizes")
        sweep.skipped += [f"replay {trace_name}, {policy} at {size} experts: {why}" for policy, size, why in skipped]
        for seed in seeds:
            for policy, size in runs:
                seeded = policy_info(policy).policy.seeded
                if not seeded and seed != seeds[0]:
                    continue  # the same run as at the first seed
                options = sweep.policy_options.get(policy)
                sweep.cells.append(Cell("replay", trace_name, policy, size, None, None, seed if seeded else None,
                                        canonical({"policy": options} if options else {})))


def _timed_cells(sweep: Sweep, check: "_Checker", policies: list[str], sizes: list, seeds: list[int]) -> None:
    timed = sweep.timed
    for trace_name, trace in sweep.traces.items():
        meta = trace.meta
        expert_bytes = timed.expert_bytes or meta.expert_bytes
        cache_bytes = sorted({check.cache_bytes(size, meta, expert_bytes, trace_name) for size in sizes})
        settings = {"arrivals": timed.arrivals, "max_batch": timed.max_batch, "history": timed.history_name,
                    "expert_bytes": expert_bytes}
        for hardware_name, hardware in timed.hardware.items():
            runs = []
            for policy, prefetcher, size in timed_runs(policies, timed.prefetchers, cache_bytes):
                where = f"timed {trace_name} on {hardware_name}, {policy} at {size} bytes"
                if policy != ALL_RESIDENT:
                    slots = min(size, meta.num_expert_slots * expert_bytes) // expert_bytes
                    if policy_info(policy).partitioned and slots < meta.num_layers:
                        reason = (f"timed {trace_name} on {hardware_name}, {policy} at {slots} experts: it needs one "
                                  f"expert per layer of {meta.num_layers}")
                        if reason not in sweep.skipped:
                            sweep.skipped.append(reason)
                        continue
                    try:
                        check_timed_run(trace, hardware, policy, size, expert_bytes,
                                        Arrivals.parse(timed.arrivals, timed.max_batch))
                    except MoeOffloadError as exc:
                        raise ConfigError(f"{check.path}: {where}: {exc}") from None
                options = dict(settings)
                if policy in sweep.policy_options:
                    options["policy"] = sweep.policy_options[policy]
                if prefetcher in timed.prefetch_options:
                    options["prefetcher"] = timed.prefetch_options[prefetcher]
                runs.append((policy, prefetcher, size, canonical(options)))
            for seed in seeds:
                sweep.cells += [Cell("timed", trace_name, policy, size, prefetcher, hardware_name, seed, options)
                                for policy, prefetcher, size, options in runs]


class _Checker:
    """Type checks that name the sweep file and the key in their one-line errors."""

    def __init__(self, path: Path):
        self.path = path

    def wrap(self, make, key: str):
        """``make()``, with any project error it raises re-raised naming the file and ``key``."""
        try:
            return make()
        except MoeOffloadError as exc:
            raise ConfigError(f"{self.path}: {key}: {exc}") from None

    def known(self, table: dict, keys: set[str], prefix: str) -> None:
        unknown = sorted(set(table) - keys)
        if unknown:
            raise ConfigError(f"{self.path}: {prefix}{unknown[0]}: unknown key (the keys are "
                              f"{', '.join(sorted(keys))}; docs/sweep-format.md)")

    def string(self, value, key: str) -> str:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{self.path}: {key}: {value!r} is not a non-empty string")
        return value

    def list_of(self, value, key: str, kinds, what: str, alternative: str = "") -> list:
        if not isinstance(value, list) or not value:
            raise ConfigError(f"{self.path}: {key}: must be {alternative}a non-empty list of {what}")
        for item in value:
            if not isinstance(item, kinds) or isinstance(item, bool):
                raise ConfigError(f"{self.path}: {key}: {item!r} is not one of the {what}")
        return list(dict.fromkeys(value))

    def names(self, value, key: str, alternative: str = "") -> list[str]:
        names = self.list_of(value, key, str, "names", alternative)
        for name in names:
            self.string(name, key)
        return names

    def options(self, value, key: str, lookup) -> dict[str, dict]:
        if not isinstance(value, dict) or not all(isinstance(options, dict) for options in value.values()):
            raise ConfigError(f"{self.path}: {key}: must hold one table per name, e.g. [{key}.NAME]")
        for name in value:
            self.wrap(lambda: lookup(name), key)
        return {name: dict(options) for name, options in value.items()}

    def experts(self, size, meta, trace_name: str) -> int:
        """A replay cache size in experts: a number of experts, a percentage ("25%") or a fraction of L*J. A
        number above the trace's L*J is all of them: one sweep may cover models of several sizes."""
        total = meta.num_expert_slots
        try:
            if isinstance(size, int):
                experts = size
            elif isinstance(size, str) and size.endswith("%"):
                percent = float(size[:-1])
                if not 0 < percent <= 100:
                    raise ValueError
                experts = round(percent / 100 * total)
            elif isinstance(size, str) and not any(c in size for c in ".eE"):
                experts = int(size)
            else:
                fraction = float(size)
                if not 0 < fraction <= 1:
                    raise ValueError
                experts = round(fraction * total)
        except ValueError:
            raise ConfigError(f"{self.path}: cache_sizes: {size!r} is neither a number of experts, a percentage in "
                              "(0, 100] nor a fraction in (0, 1] (byte sizes are for timed sweeps only)") from None
        if experts < 1:
            raise ConfigError(f"{self.path}: cache_sizes: {size!r} gives {experts} experts for trace {trace_name} "
                              f"({total} experts)")
        return min(experts, total)

    def cache_bytes(self, size, meta, expert_bytes: int, trace_name: str) -> int:
        """A timed cache size in bytes: bytes with a unit ("4GiB"), else experts as for the replay, in whole
        experts (simulate --timed's rule)."""
        if isinstance(size, str) and size[-1:].lower() == "b":
            return self.wrap(lambda: parse_bytes(size, "cache size"), "cache_sizes")
        return self.experts(size, meta, trace_name) * expert_bytes
