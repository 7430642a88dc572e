"""Access-level replay: demand paging of the layered-paging model (paper 001).

The trace is flattened into expert requests (moe_offload.trace.flatten documents the order); each request is a
hit if the expert is resident, otherwise a miss that loads it, evicting the policy's victim when the cache is
full, or that the policy bypasses (served where the expert lives, not loaded: a static placement, loaded
before the first request, never admits); after the last token of a request the cache hears that the request
has ended (a policy's per-sequence state ends with it). No clock, no prefetch: this is the model in which
Belady's OPT is optimal, so every policy's misses are reported against OPT on the same sequence.

Two engines make the same decisions: the policy objects driven through ExpertCache (the reference, any
policy), and the policies' compiled kernels (simulator/kernels.py), which the replay uses by default where
a policy has one and Numba is installed: tens of times faster. One run is ``replay``; many, each policy at
each size against OPT, are a grid (grid.py).
"""

from __future__ import annotations

import dis
import functools
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.policies import AccessContext, ModelSpec, policy_factory, policy_info
from moe_offload.results import RunResult
from moe_offload.simulator import kernels
from moe_offload.simulator.cache import BYPASSED, HIT, LOADED, ExpertCache
from moe_offload.simulator.partitioned_cache import PartitionedCache
from moe_offload.trace.flatten import COLUMN, AccessSequence, flatten, last_row_of_each_request, sample_sequence
from moe_offload.trace.format import Trace
from moe_offload.values import integer


@dataclass
class ReplayInput:
    """A trace and its request sequence (flattened when first asked for), prepared once for many runs; or the
    requests of a spatial sample of its experts (``sampled``)."""

    trace: Trace
    name: str
    _sequence: AccessSequence | None = None

    @classmethod
    def of(cls, trace: Trace, name: str | None = None, *, checked: bool = False) -> "ReplayInput":
        """``trace``, checked first as a file is (``checked``: read_trace or Trace.build has just checked it, a
        pass over the trace saved)."""
        if not checked:
            trace.validate()
        return cls(trace=trace, name=name or trace.path)

    @classmethod
    def sampled(cls, trace: Trace, rate: float, name: str) -> "ReplayInput":
        """The requests of the experts in a spatial sample at ``rate`` of ``trace`` (a checked trace;
        trace/flatten.py ``sample_sequence``), never the whole sequence in memory."""
        return cls(trace=trace, name=name, _sequence=sample_sequence(trace, rate))

    @property
    def sequence(self) -> AccessSequence:
        if self._sequence is None:
            self._sequence = flatten(self.trace)
        return self._sequence

    @property
    def is_sample(self) -> bool:
        return self._sequence is not None and self._sequence.sampled

    def requests(self) -> int:
        """The requests a replay serves: every request of the trace, or of the sample (nothing flattened)."""
        if self.is_sample:
            return len(self._sequence)
        meta = self.trace.meta
        return self.trace.num_tokens * meta.num_layers * meta.top_k

    def per_layer_requests(self) -> np.ndarray:
        if self.is_sample:
            return self._sequence.per_layer_requests()
        meta = self.trace.meta
        return np.full(meta.num_layers, self.trace.num_tokens * meta.top_k, np.int64)

    def layer_requests(self, first: int, stop: int, tokens: bool) -> tuple[list, list]:
        """The requests of each of layers ``first`` .. ``stop``-1 in time order: their flat ids and, where
        ``tokens``, their trace rows (else NOT_READ), as int32 arrays. Gathered from the sequence where it is
        flattened already (a sample's always is), else read off the trace itself, a row's K experts of the layer
        after the row before's, so that a -dist replay alone never flattens the whole sequence (a day of
        traffic's would be gigabytes). The same arrays either way; from the sequence twice as fast (0.05 s
        against 0.10 s for the ids of 48 layers at 38.4M requests, on the 2-core machine)."""
        if self._sequence is not None:
            seq = self._sequence
            keys = seq.layer_columns(seq.expert_id, first, stop)
            return keys, seq.layer_columns(seq.token, first, stop) if tokens else [NOT_READ] * len(keys)
        experts, num_experts = self.trace.experts, self.trace.meta.num_experts
        keys = []
        for layer in range(first, stop):
            ids = experts[:, layer, :].astype(COLUMN).reshape(-1)
            ids += COLUMN(layer * num_experts)
            keys.append(ids)
        rows = NOT_READ
        if tokens:
            rows = np.repeat(np.arange(self.trace.num_tokens, dtype=COLUMN), self.trace.meta.top_k)
        return keys, [rows] * len(keys)

    @property
    def spec(self) -> ModelSpec:
        meta = self.trace.meta
        return ModelSpec(meta.num_layers, meta.num_experts, meta.top_k)


def check_cache_size(policy: str, cache_size: int, spec: ModelSpec) -> None:
    """Raise ConfigError when ``policy`` cannot run with ``cache_size`` experts. A static placement computes
    what it does not hold where it lives, so any size will do."""
    if cache_size < spec.top_k and not policy_info(policy).policy.static:
        raise ConfigError(f"a cache of {cache_size} experts is smaller than top-k = {spec.top_k}: one layer's "
                          f"selected experts could not be resident together")
    if policy_info(policy).partitioned and cache_size < spec.num_layers:
        raise ConfigError(f"{policy} splits the cache among {spec.num_layers} layers and needs at least one "
                          f"expert per layer, but the cache holds {cache_size}")


ENGINES = ("auto", "compiled", "python")


def replay(data: ReplayInput, policy: str, cache_size: int, *, seed: int = 0,
           options: dict | None = None, engine: str = "auto") -> RunResult:
    """Replay ``data`` through ``policy`` with room for ``cache_size`` experts.

    ``engine`` chooses how, never what: "python" drives the policy object through the cache, "compiled" runs
    the policy's compiled kernel (simulator/kernels.py; ConfigError without Numba or without a kernel), and
    "auto" (the default) the kernel where the policy has one and Numba is installed, else the object. Both
    make the same decisions, so the result is the same."""
    spec = data.spec
    cache_size = integer(cache_size, "cache_size", low=1)
    check_cache_size(policy, cache_size, spec)
    info = policy_info(policy)
    make = policy_factory(policy, spec, seed=seed, options=options)
    whole_layers = info.whole_layers(options, spec)
    if info.partitioned:  # refuses a budget its whole layers do not fit, before any work
        PartitionedCache.capacities(cache_size, spec.num_layers, spec.num_experts, whole_layers)
    in_hindsight = info.policy.places_or_bypasses and make().in_hindsight  # built only for placements
    kernel = replay_kernel(policy, engine)
    if kernel is not None:
        layer_hits = _replay_compiled(data, info, make(), cache_size, kernel, whole_layers)
        layer_bypassed = np.zeros(spec.num_layers, np.int64)
    else:
        layer_hits, layer_bypassed = _replay_objects(data, info, make, cache_size, whole_layers)

    n = data.requests()
    per_layer_accesses = data.per_layer_requests()
    if kernel is not None and info.policy.static:  # it loads no miss: what it does not hit is bypassed
        layer_bypassed = per_layer_accesses - layer_hits
    hits = int(layer_hits.sum())
    bypassed = int(layer_bypassed.sum())
    misses = n - hits - bypassed
    expert_bytes = data.trace.meta.expert_bytes
    notes = run_notes(policy, data, in_hindsight)
    return RunResult(trace=data.name, policy=policy, cache_size=cache_size, accesses=n, hits=hits, misses=misses,
                     in_hindsight=in_hindsight,
                     per_layer_accesses=per_layer_accesses.tolist(), per_layer_hits=layer_hits.tolist(),
                     bypassed=bypassed if info.policy.places_or_bypasses else None,
                     per_layer_bypassed=layer_bypassed.tolist() if info.policy.places_or_bypasses else None,
                     bytes_loaded=misses * expert_bytes if expert_bytes else None, notes=notes)


def run_notes(policy: str, data: ReplayInput, in_hindsight: bool) -> list[str]:
    notes = []
    if policy_info(policy).policy.needs_probs and data.trace.probs is None:
        notes.append(f"{policy}: the trace has no router probabilities, so p is uniform "
                     "(fmoe then ranks like LFU)")
    if in_hindsight:
        notes.append(f"{policy}: placed in hindsight, from the trace it runs on (give it a profile trace to make "
                     "it an online placement); not ranked among the online policies")
    return notes


def replay_kernel(policy: str, engine: str = "auto"):
    """The compiled kernel ``engine`` chooses for ``policy`` (see ``replay``), or None for the policy object.
    The first call for a policy in a process compiles its kernel (or loads it from Numba's cache)."""
    if engine not in ENGINES:
        raise ConfigError(f"replay engine {engine!r} is not one of {', '.join(ENGINES)}")
    if engine == "python":
        return None
    policy_class = policy_info(policy).policy
    kernel = kernels.compiled_kernel(policy_class)
    if kernel is None and engine == "compiled":
        if policy_class.replay_kernel is None:
            raise ConfigError(f"{policy} has no compiled kernel; its replay runs the Python policy (engine auto)")
        raise ConfigError(f"the compiled replay of {policy} needs Numba: {kernels.INSTALL_HINT}")
    return kernel


def load_kernels(policies: Iterable[str], engine: str = "auto") -> None:
    """Compile, or load from Numba's cache, the kernels a grid of ``policies`` runs (Belady's with them). A
    command calls it on a thread while it reads its traces (Arrow reads without the GIL), and waits for it
    before the first replay: the kernels' loading, a second or more, is then off the path."""
    for policy in dict.fromkeys(["belady", *policies]):
        replay_kernel(policy, engine)


def _replay_objects(data: ReplayInput, info, make, cache_size: int, whole_layers=()) -> tuple[np.ndarray, np.ndarray]:
    """The reference: every request through ExpertCache and the policy object, after the policy's static
    placement (if any) and a -dist cache's whole layers. Hits and bypassed requests per layer."""
    spec = data.spec
    if info.partitioned:
        cache = PartitionedCache(cache_size, spec.num_layers, make, spec.num_experts, whole_layers=whole_layers)
    else:
        cache = ExpertCache(cache_size, make())
    seq, trace = data.sequence, data.trace
    ctx = AccessContext()
    cache.preload(trace, ctx)
    n = len(seq)
    keys, layers, tokens = seq.expert_id.tolist(), seq.layer.tolist(), seq.token.tolist()
    next_use = seq.next_use.tolist() if info.offline else None
    probs = trace.probs
    request_ids, iterations = trace.request.tolist(), trace.iteration.tolist()
    last_rows = set(last_row_of_each_request(trace.request).tolist())
    outcomes = bytearray(n)  # 0 loaded, 1 hit, 2 bypassed
    code = {HIT: 1, LOADED: 0, BYPASSED: 2}
    serve = cache.serve
    current_token = -1
    for t in range(n):
        ctx.clock = t
        ctx.layer = layers[t]
        token = tokens[t]
        if token != current_token:
            if current_token in last_rows:  # its request has run its last token
                cache.end_request(ctx.request)
            current_token = ctx.token = token
            ctx.request = request_ids[token]
            ctx.iteration = iterations[token]
            if probs is not None:
                ctx.probs = probs[token]
        if next_use is not None:
            ctx.next_use = next_use[t]
        outcomes[t] = code[serve(keys[t], ctx)]
    if current_token in last_rows:
        cache.end_request(ctx.request)

    outcome = np.frombuffer(bytes(outcomes), dtype=np.uint8)
    return tuple(np.bincount(seq.layer[outcome == value], minlength=spec.num_layers).astype(np.int64)
                 for value in (1, 2))


def _replay_compiled(data: ReplayInput, info, policy, cache_size: int, kernel, whole_layers=()) -> np.ndarray:
    """The same replay through the policy's kernel; a -dist policy runs it once per layer, on that layer's
    requests and its partition's capacity (PartitionedCache's split), and a layer it holds whole hits every
    request. Hits per layer."""
    spec = data.spec
    floats, ints = policy.run_kernel_arguments(cache_size, data.trace)
    reads_tokens = "token" in kernel_columns(info.name)
    key_hits = np.zeros(spec.num_layers * spec.num_experts, np.int64)
    if not info.partitioned:
        seq = data.sequence
        kernel(seq.expert_id, seq.token if reads_tokens else NOT_READ, cache_size, spec.num_layers, spec.num_experts,
               floats, ints.copy(), key_hits)  # int32 columns, the kernel's signature: no copy here
    else:
        capacities = PartitionedCache.capacities(cache_size, spec.num_layers, spec.num_experts, whole_layers)
        # the layers' requests a group at a time (GATHER_BYTES of ids), each layer's a few megabytes that the
        # kernel's passes read in its cache; each partition has a fresh policy of the same seed (PartitionedCache's
        # make_policy), hence ints.copy()
        group = max(1, GATHER_BYTES // max(1, COLUMN().itemsize * int(data.per_layer_requests().max(initial=0))))
        for first in range(0, spec.num_layers, group):
            stop = min(spec.num_layers, first + group)
            if all(layer in whole_layers for layer in range(first, stop)):
                continue
            layer_keys, layer_tokens = data.layer_requests(first, stop, reads_tokens)
            for layer in range(first, stop):
                if layer not in whole_layers:
                    kernel(layer_keys[layer - first], layer_tokens[layer - first], capacities[layer],
                           spec.num_layers, spec.num_experts, floats, ints.copy(), key_hits)
            del layer_keys, layer_tokens
    layer_hits = key_hits.reshape(spec.num_layers, spec.num_experts).sum(axis=1)
    if whole_layers:  # every expert of these resident from the start: every request a hit
        held = sorted(whole_layers)
        layer_hits[held] = data.per_layer_requests()[held]
    return layer_hits


GATHER_BYTES = 1 << 26  # of ids gathered by layer at once for a -dist kernel (20 of 48 layers at 38.4M)
NOT_READ = np.zeros(0, np.int32)  # what a kernel is given for a column its code never reads
TOKENS_ARGUMENT = 1  # its place in the kernels' contract (simulator/kernels.py)


def kernel_columns(policy: str) -> tuple[str, ...]:
    """The computed columns of the sequence (AccessSequence) that ``policy``'s kernel reads."""
    return ("token",) if kernel_reads(policy_info(policy).policy, TOKENS_ARGUMENT) else ()


@functools.cache
def kernel_reads(policy_class, argument: int) -> bool:
    """Whether ``policy_class``'s kernel reads its positional argument number ``argument``: whether its code
    loads that parameter at all (passing it to a helper counts as reading it). A column no kernel of a run
    reads is never computed (AccessSequence computes them when first asked for)."""
    code = policy_class.replay_kernel.__code__
    name = code.co_varnames[argument]
    return any(instruction.opname.startswith("LOAD_FAST")  # LOAD_FAST_LOAD_FAST (3.13) loads a pair
               and name in (instruction.argval if isinstance(instruction.argval, tuple) else (instruction.argval,))
               for instruction in dis.get_instructions(code))
