"""Measure this machine for the timed simulator: a hardware profile from micro-benchmarks on a packed model.

What the runtime (runtime/engine.py) does with an expert, timed piece by piece on the real files and shapes:

- the link from the packed files into the fast tier, timed through the runtime's own data path
  (runtime/datapath.py ``ExpertMover``: the reader pool's chunked reads, the checksums, the conversion to
  float32 on a CPU, the pinned ring and the copy stream with CUDA), experts moved one after another as a
  link worker moves them, optionally with the files dropped from the page cache first, so the numbers are
  the device's, not RAM's. Its throughput is the link's bandwidth, one expert moved alone its latency;
- beside it, the raw rates that bound it, measured in the same run: the reader pool reading experts into
  memory (parallel read), the conversion (CPU) or the pinned host -> GPU copy (CUDA);
- one expert's computation (the per-expert work of models/experts.py: select tokens, gate_up, activation,
  down, routing weight, index_add) at 1, 2, 4, ..., 64 tokens, fitted to the profile's roofline;
- the rest of an iteration (attention, routers, LM head) by running the packed model's skeleton with the
  experts stubbed out and timing its modules with hooks;
- one whole decode step of the runtime with every expert resident (OffloadEngine, preloaded, greedy
  generate): what the parts above do not explain (transformers' generate loop, the hooks, Python between the
  kernels) is framework overhead per token. It is spread over the layers (added to the attention's fixed
  cost, which the simulator charges once per layer), because that is where the Python runs: between one
  router and the next, which is the window a prefetch has. Without it the simulator would predict a decode
  step the runtime never achieves, and prefetch windows shorter than the runtime's.

The tiers are the runtime's: the fast tier (``gpu`` with CUDA, else ``host``: RAM holding compute-ready
experts) and ``ssd`` (the packed files), with one link ``ssd->gpu`` / ``ssd->host`` that carries what the
data path does, since without a host tier the runtime reads every expert from the files straight into the
fast tier. With ``host_budget`` (CUDA only) the profile has the runtime's three tiers ``gpu``, ``host`` (of
that budget) and ``ssd``, with the links ``host->gpu`` (one pinned copy) and ``ssd->host`` (reads into
pinned host slots). The simulator charges every transfer and every memory term in the trace's stored expert
bytes, so every rate here is in stored bytes per second.

Timings are medians over ``repeats``; short operations are timed in batches of at least a few milliseconds
so that the clock's resolution does not matter.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from moe_offload.errors import ConfigError
from moe_offload.runtime.packing import Manifest, load_skeleton, read_manifest
from moe_offload.runtime.storage import ExpertStore

TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64)
MIN_SAMPLED_FILES = 16
MAX_SAMPLED_FILES = 64
MIN_BATCH_S = 2e-3             # a timed batch of short calls lasts at least this long
MEMORY_PROBE_BYTES = {"cpu": 64 << 20, "cuda": 1 << 30}  # well past the caches (an H100's L2 is 50 MB)
COPY_PROBE_BYTES = 64 << 20    # a pinned host -> GPU copy this long runs at the link's rate
SIGNIFICANT_DIGITS = 4         # the profile's numbers: more would only record noise
NO_EXPERTS = "moe_offload_measure_no_experts"


@dataclass
class Measurements:
    """The raw numbers behind a measured profile (seconds, bytes, bytes per second)."""

    device: str                     # "cpu" or "cuda"
    device_name: str
    packed_dir: Path
    model_name: str                 # how the sources name the model
    model_type: str
    stored_dtype: str
    compute_dtype: str
    expert_bytes: int               # one expert's tensors in the stored dtype (what the simulator charges)
    expert_params: int
    files_sampled: int              # experts moved per repeat
    files_total: int
    bypass_page_cache: bool
    repeats: int
    readers: int                    # reader threads of the data path
    link_seconds: float             # one expert through the data path, in a stream of them (throughput)
    link_alone_s: float             # one expert through the data path on its own (latency + bytes)
    parallel_read_bandwidth: float  # the reader pool reading experts into memory, no conversion
    convert_bandwidth: float | None  # CPU: stored dtype -> float32 copies of whole experts
    host_link_seconds: float | None  # with a host tier: one expert read into a pinned host slot (stream)
    host_budget_bytes: int | None
    host_to_gpu_latency_s: float | None
    host_to_gpu_bandwidth: float | None
    memory_bandwidth: float         # streaming read of the compute device's memory
    expert_seconds: dict[int, float]             # tokens -> one expert's compute
    non_expert_seconds: dict[str, dict[int, float]]  # attention / router / lm_head -> tokens -> seconds
    num_layers: int
    capacities: dict[str, int]      # tier -> bytes
    capacity_notes: dict[str, str]
    threads: int
    decode_step_s: float | None = None          # one all-resident decode step of the runtime, end to end
    elapsed_s: float = 0.0
    date: str = field(default_factory=lambda: datetime.datetime.now().astimezone().isoformat(timespec="seconds"))


# ----------------------------------------------------------------------------------------------- timing helpers
def _median(values) -> float:
    return float(statistics.median(values))


def _synchronizer(device):
    import torch

    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_per_call(fn, repeats: int, sync=lambda: None) -> float:
    """Median seconds of one ``fn()``: a warm-up call, then ``repeats`` batches of as many calls as make a
    batch last MIN_BATCH_S (one call of a few microseconds is below what the clock can resolve)."""
    fn()
    sync()
    calls, elapsed = 1, 0.0
    while True:  # calibrate the batch size
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        elapsed = time.perf_counter() - started
        if elapsed >= MIN_BATCH_S or calls >= 1 << 12:
            break
        calls *= 4 if elapsed < MIN_BATCH_S / 8 else 2
    samples = [elapsed / calls]
    for _ in range(repeats - 1):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - started) / calls)
    return _median(samples)


def fit_line(xs, ys) -> tuple[float, float]:
    """Ordinary least squares ``y = intercept + slope * x``."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        return mean_y, 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    return mean_y - slope * mean_x, slope


def fit_linear_cost(tokens, seconds) -> tuple[float, float]:
    """``fixed_s + per_token_s * n`` with both at least 0 (the profile refuses negative costs): the least-squares
    line, or the best line with the offending coefficient held at 0 when noise makes one negative."""
    fixed, per_token = fit_line(tokens, seconds)
    if per_token < 0:
        return max(sum(seconds) / len(seconds), 0.0), 0.0
    if fixed < 0:  # through the origin
        return 0.0, sum(n * t for n, t in zip(tokens, seconds)) / sum(n * n for n in tokens)
    return fixed, per_token


def _round(value: float) -> float:
    return float(f"{value:.{SIGNIFICANT_DIGITS}g}") if math.isfinite(value) else value


# ------------------------------------------------------------------------------------------------ the slow tier
def sample_experts(manifest: Manifest, at_most: int = MAX_SAMPLED_FILES) -> list[tuple[int, int]]:
    """Every expert when there are at most ``at_most``, else ``at_most`` of them evenly spread over the
    layers (files of one layer tend to lie together on the disk; a sample from every layer does not flatter)."""
    keys = sorted(manifest.experts)
    if len(keys) <= at_most:
        return keys
    step = len(keys) / at_most
    return [keys[int(i * step)] for i in range(at_most)]


def fit_latency_bandwidth(nbytes: int, stream_s: float, alone_s: float) -> tuple[float, float]:
    """(latency_s, bytes per second) of a link from one transfer of ``nbytes`` in a stream of them
    (``stream_s`` each: the bandwidth, since a stream overlaps what it can) and one alone (``alone_s``: the
    latency is what it takes beyond the stream's time, at least 0)."""
    return max(0.0, alone_s - stream_s), nbytes / max(stream_s, 1e-12)


def _itemsize(dtype_name: str) -> int:
    import torch

    return getattr(torch, dtype_name).itemsize


def measure_link(manifest: Manifest, keys, repeats: int, bypass_page_cache: bool, device, dtype,
                 readers: int | None = None, pinned_host: bool = False) -> tuple[float, float]:
    """(seconds per expert in a stream, seconds for one expert alone) through the runtime's data path from
    the files into a tier on ``device`` in ``dtype`` (``pinned_host``: a pinned host slot, as a host tier in
    front of a GPU); the stream is ``keys`` moved back to back (medians over ``repeats``), CUDA copies
    included (synchronised at the end)."""
    from moe_offload.runtime.datapath import ExpertMover
    from moe_offload.runtime.storage import ExpertStore
    from moe_offload.runtime.tiers import SlotPool, Tier

    store = ExpertStore(manifest, bypass_page_cache=bypass_page_cache, readers=readers)
    elements = manifest.expert_bytes // _itemsize(manifest.dtype)
    tier = Tier("fast", None, SlotPool(2, elements, dtype, device, pin=pinned_host), manifest, device, dtype)
    mover = ExpertMover(store, manifest.num_experts)
    sync = _synchronizer(device)
    try:
        for layer, expert in keys:  # first reads check SHA-256; the runtime's later reads check xxHash3
            mover.move(layer * manifest.num_experts + expert, None, None, tier, 0)
        sync()
        streams, alone = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            for i, (layer, expert) in enumerate(keys):
                mover.move(layer * manifest.num_experts + expert, None, None, tier, i % 2)
            sync()
            streams.append((time.perf_counter() - started) / len(keys))
            layer, expert = keys[0]
            started = time.perf_counter()
            mover.move(layer * manifest.num_experts + expert, None, None, tier, 0)
            sync()
            alone.append(time.perf_counter() - started)
    finally:
        store.close()
    return _median(streams), _median(alone)


def measure_raw_rates(manifest: Manifest, keys, repeats: int, bypass_page_cache: bool,
                      readers: int | None = None) -> tuple[float, float]:
    """(parallel read, conversion) in stored bytes per second: the reader pool reading experts into a buffer
    that is already mapped (no checksum, no conversion), and a float32 copy of the experts' float16 (or other
    stored dtype) elements from memory by as many threads as the pool has readers. The bounds of the CPU data
    path: every expert is read, then converted."""
    import torch

    from moe_offload.runtime.storage import ExpertStore

    store = ExpertStore(manifest, verify=False, bypass_page_cache=bypass_page_cache, readers=readers)
    size = manifest.expert_bytes
    buffer = torch.zeros(len(keys) * size, dtype=torch.uint8)  # zeros: every page mapped before timing
    array = buffer.numpy()
    reads = []
    try:
        for _ in range(repeats + 1):
            started = time.perf_counter()
            for i, (layer, expert) in enumerate(keys):
                base = i * size
                store.read(layer, expert, lambda a, b, base=base: memoryview(array[base + a:base + b]))
            reads.append(time.perf_counter() - started)
    finally:
        store.close()
    stored = buffer.view(getattr(torch, manifest.dtype))
    target = torch.zeros(stored.numel(), dtype=torch.float32)
    workers = store.readers
    step = -(-stored.numel() // workers)
    parts = [(target[i:i + step], stored[i:i + step]) for i in range(0, stored.numel(), step)]
    converts = []
    with ThreadPoolExecutor(workers) as pool:  # as many converting threads as the data path has readers
        for _ in range(repeats + 1):
            started = time.perf_counter()
            list(pool.map(lambda pair: pair[0].copy_(pair[1]), parts))
            converts.append(time.perf_counter() - started)
    total = len(keys) * size
    return total / _median(reads[1:]), total / _median(converts[1:])


def measure_pinned_copy(nbytes: int, repeats: int) -> float:
    """Bytes per second of a memcpy into pinned host memory (CUDA machines: what filling the ring costs
    once the bytes are in RAM)."""
    import torch

    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return nbytes / time_per_call(lambda: target.copy_(source), repeats)


# ---------------------------------------------------------------------------------------------- memory and PCIe
def measure_memory_bandwidth(device, repeats: int) -> float:
    """Bytes per second of a streaming read of the compute device's memory (a sum over a buffer larger than
    any cache): the roofline's memory term, what reading an expert's weights costs once they no longer fit
    in a cache."""
    import torch

    size = MEMORY_PROBE_BYTES[device.type]
    buffer = torch.ones(size // 4, dtype=torch.float32, device=device)
    seconds = time_per_call(lambda: buffer.sum(), repeats, _synchronizer(device))
    return size / seconds


def measure_host_to_gpu(device, expert_bytes: int, repeats: int) -> tuple[float, float]:
    """(latency_s, bytes per second) of pinned host -> GPU copies: the latency from a 4-byte copy, the
    bandwidth from a copy of at least 64 MiB (one small expert is too short to reach the link's rate)."""
    import torch

    sync = _synchronizer(device)
    tiny = torch.ones(1, dtype=torch.float32).pin_memory()
    latency = time_per_call(lambda: tiny.to(device, non_blocking=True), repeats, sync)
    size = max(COPY_PROBE_BYTES, expert_bytes)
    big = torch.ones(size, dtype=torch.uint8).pin_memory()
    seconds = time_per_call(lambda: big.to(device, non_blocking=True), repeats, sync)
    return min(latency, seconds / 2), size / (seconds - min(latency, seconds / 2))


# ------------------------------------------------------------------------------------------------------ compute
def measure_expert_compute(experts_module, tensors: dict, device, dtype, repeats: int,
                           token_counts=TOKEN_COUNTS) -> dict[int, float]:
    """Seconds of one expert's work on n tokens, n in ``token_counts``: the per-expert body of
    models/experts.py (select the expert's tokens, gate_up, the module's own activation, down, the routing
    weight, index_add) with the expert's real weights, so shapes, dtype and activation are the model's."""
    import torch
    import torch.nn.functional as F

    gate_up = tensors["gate_up_proj"].to(device, dtype=dtype)
    down = tensors["down_proj"].to(device, dtype=dtype)
    hidden = gate_up.shape[1]
    generator = torch.Generator().manual_seed(0)
    results = {}
    for n in token_counts:
        states = torch.randn(n, hidden, generator=generator).to(device, dtype=dtype)
        top_k_index = torch.zeros(n, 1, dtype=torch.long, device=device)
        top_k_weights = torch.ones(n, 1, dtype=dtype, device=device)
        out = torch.zeros_like(states)

        def one_expert():
            top_k_pos, token_idx = torch.where((top_k_index == 0).transpose(0, 1))
            current = experts_module._apply_gate(F.linear(states[token_idx], gate_up))
            current = F.linear(current, down) * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, current)

        with torch.inference_mode():
            results[n] = time_per_call(one_expert, repeats, _synchronizer(device))
    return results


def _no_experts(self, hidden_states, top_k_index, top_k_weights):
    """An experts implementation that computes nothing: the skeleton's forward without the routed experts."""
    import torch

    return torch.zeros_like(hidden_states)


class _ModuleTimer:
    """Forward hooks that add up the seconds each group of modules spends, synchronizing a GPU first so
    that the time is the module's and not its predecessor's."""

    def __init__(self, sync):
        self.sync, self.seconds, self._started, self._handles = sync, {}, {}, []

    def watch(self, group: str, module) -> None:
        def before(mod, args):
            self.sync()
            self._started[id(mod)] = time.perf_counter()

        def after(mod, args, output):
            self.sync()
            self.seconds[group] = self.seconds.get(group, 0.0) + time.perf_counter() - self._started.pop(id(mod))

        self._handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def reset(self) -> None:
        self.seconds = {}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def measure_non_expert(model, adapter, device, repeats: int, token_counts=TOKEN_COUNTS) -> dict[str, dict[int, float]]:
    """Seconds per MoE layer of attention (everything a decoder layer does besides its router and its routed
    experts: norms, attention, residuals, shared experts, dense layers' MLPs) and of the router, and once per
    iteration of the LM head (everything outside the decoder layers: embedding, final norm, LM head), for a
    forward of n tokens with the routed experts stubbed out. Prefill without a KV cache: the simulator's
    costs are functions of the iteration's tokens only."""
    import torch
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if NO_EXPERTS not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(NO_EXPERTS, _no_experts)
    model.set_experts_implementation(NO_EXPERTS)
    sync = _synchronizer(device)
    timer = _ModuleTimer(sync)
    for layer in model.model.layers:
        timer.watch("layers", layer)
    for moe_layer in range(adapter.num_layers):
        timer.watch("router", adapter.router(moe_layer))
        timer.watch("experts", adapter.experts(moe_layer))
    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    results = {"attention": {}, "router": {}, "lm_head": {}}
    try:
        with torch.inference_mode():
            for n in token_counts:
                ids = torch.randint(0, vocab, (1, n), generator=generator).to(device)
                samples = {"attention": [], "router": [], "lm_head": []}
                for attempt in range(repeats + 1):  # the first is a warm-up
                    timer.reset()
                    sync()
                    started = time.perf_counter()
                    model(input_ids=ids, use_cache=False)
                    sync()
                    total = time.perf_counter() - started
                    if attempt == 0:
                        continue
                    layers, router = timer.seconds["layers"], timer.seconds.get("router", 0.0)
                    experts = timer.seconds.get("experts", 0.0)
                    samples["attention"].append((layers - router - experts) / adapter.num_layers)
                    samples["router"].append(router / adapter.num_layers)
                    samples["lm_head"].append(total - layers)
                for part, values in samples.items():
                    results[part][n] = max(_median(values), 0.0)
    finally:
        timer.close()
    return results


# ---------------------------------------------------------------------------------------------------- capacities
def _available_ram() -> int:
    """Bytes of RAM available now (MemAvailable: free plus reclaimable cache), else the free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def capacities(packed_dir: Path, device, stored_itemsize: int, compute_itemsize: int, host_bytes: int | None = None):
    """(tier -> bytes, tier -> how it was found): the runtime's tiers (module docstring). Capacities are in
    stored expert bytes, the simulator's unit: a CPU's fast tier holds float32 copies, so its RAM holds fewer
    stored bytes than its size."""
    import torch

    ram = _available_ram()
    sizes, notes = {}, {}
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        sizes["gpu"] = free
        notes["gpu"] = "free GPU memory at measurement time"
        if host_bytes is not None:
            sizes["host"] = host_bytes
            notes["host"] = "the host tier's budget (pinned RAM)"
    else:
        sizes["host"] = ram * stored_itemsize // compute_itemsize
        notes["host"] = (f"RAM available at measurement time (MemAvailable), in stored bytes: it holds "
                         f"compute-ready copies {compute_itemsize // stored_itemsize}x their stored size")
    sizes["ssd"] = shutil.disk_usage(packed_dir).total
    notes["ssd"] = f"size of the file system holding {packed_dir}"
    return sizes, notes


def capacity_text(count: int) -> str:
    """A capacity rounded down to whole GiB (whole MiB below 1 GiB), as the presets write them."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if count >= size:
            return f"{count // size} {unit}"
    return str(max(int(count), 1))


# -------------------------------------------------------------------------------------------------- the profile
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(packed_dir, *, repeats: int = 5, bypass_page_cache: bool = True, device=None,
            max_files: int = MAX_SAMPLED_FILES, threads: int | None = None,
            model_name: str | None = None, readers: int | None = None, host_budget=None) -> Measurements:
    """Run every micro-benchmark on the packed model in ``packed_dir`` (see the module docstring).
    ``threads``: torch's CPU threads while measuring (default: as they are, which is what the runtime uses);
    restored afterwards. ``model_name``: how the profile's sources name the model (default: the directory).
    ``readers``: the data path's reader threads (default: the runtime's). ``host_budget`` (CUDA): profile the
    runtime with a host tier of this budget."""
    import torch

    if repeats < 1:
        raise ConfigError(f"repeats must be at least 1, not {repeats}")
    if max_files < MIN_SAMPLED_FILES:
        raise ConfigError(f"max_files must be at least {MIN_SAMPLED_FILES}, not {max_files}")
    if threads is not None and threads < 1:
        raise ConfigError(f"threads must be at least 1, not {threads}")
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _measure(packed_dir, repeats, bypass_page_cache, device, max_files, model_name, readers, host_budget)
    finally:
        torch.set_num_threads(before)


def _measure(packed_dir, repeats: int, bypass_page_cache: bool, device, max_files: int,
             model_name: str | None, readers: int | None, host_budget) -> Measurements:
    import torch

    from moe_offload.models import quiet_transformers
    from moe_offload.runtime.engine import parse_budget, resolve_device
    from moe_offload.runtime.storage import default_readers

    started = time.perf_counter()
    quiet_transformers()
    device = resolve_device(device)
    manifest = read_manifest(packed_dir)
    stored = getattr(torch, manifest.dtype)
    compute_dtype = torch.float32 if device.type == "cpu" else stored  # as OffloadEngine computes
    keys = sample_experts(manifest, max_files)
    bypass = bypass_page_cache and hasattr(os, "posix_fadvise")
    host_bytes = None
    if host_budget is not None:
        if device.type != "cuda":
            raise ConfigError("a host tier is measured in front of a GPU only (on a CPU the fast tier is the RAM)")
        host_bytes = parse_budget(host_budget, manifest.expert_bytes * len(manifest.experts), "--host-budget")

    link_s, alone_s = measure_link(manifest, keys, repeats, bypass, device, compute_dtype, readers)
    parallel_read, convert = measure_raw_rates(manifest, keys, repeats, bypass, readers)
    host_link_s = h2d_latency = h2d_bandwidth = None
    if device.type == "cuda":
        h2d_latency, h2d_bandwidth = measure_host_to_gpu(device, manifest.expert_bytes, repeats)
        if host_bytes is not None:
            host_link_s, _ = measure_link(manifest, keys, repeats, bypass, torch.device("cpu"), stored, readers,
                                          pinned_host=True)
    memory_bandwidth = measure_memory_bandwidth(device, repeats)

    model, adapter, _ = load_skeleton(manifest, device, compute_dtype, verify=False)
    tensors = ExpertStore(manifest).read_tensors(*keys[0])
    expert_seconds = measure_expert_compute(adapter.experts(0), tensors, device, compute_dtype, repeats)
    non_expert = measure_non_expert(model, adapter, device, repeats)
    del model
    decode_step = measure_decode_step(Path(packed_dir), device, repeats)
    sizes, notes = capacities(Path(packed_dir), device, stored.itemsize, compute_dtype.itemsize, host_bytes)

    params = sum(t.numel() for t in tensors.values())
    return Measurements(
        device=device.type, device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        packed_dir=Path(packed_dir).resolve(), model_name=model_name or str(Path(packed_dir).resolve()),
        model_type=manifest.model_type, stored_dtype=manifest.dtype,
        compute_dtype=str(compute_dtype).removeprefix("torch."),
        expert_bytes=manifest.expert_bytes, expert_params=params, files_sampled=len(keys),
        files_total=len(manifest.experts), bypass_page_cache=bypass, repeats=repeats,
        readers=readers or default_readers(), link_seconds=link_s, link_alone_s=alone_s,
        parallel_read_bandwidth=parallel_read, convert_bandwidth=convert if device.type == "cpu" else None,
        host_link_seconds=host_link_s, host_budget_bytes=host_bytes, host_to_gpu_latency_s=h2d_latency, host_to_gpu_bandwidth=h2d_bandwidth, memory_bandwidth=memory_bandwidth,
        expert_seconds=expert_seconds, non_expert_seconds=non_expert, num_layers=manifest.num_layers,
        capacities=sizes, capacity_notes=notes, threads=torch.get_num_threads(), decode_step_s=decode_step,
        elapsed_s=time.perf_counter() - started)


DECODE_PROBE_TOKENS = 16


def measure_decode_step(packed_dir: Path, device, repeats: int) -> float:
    """Median time between two output tokens of the runtime with every expert preloaded (greedy, a fixed
    16-token prompt, 16 new tokens, ``repeats`` times): the all-resident TPOT the simulator's costs must add up
    to. The median of the gaps, not their mean: a burst of other work on the machine moves a mean, not it."""
    from moe_offload.runtime.engine import OffloadEngine

    with OffloadEngine(packed_dir, fast_budget="100%", preload=True, device=device) as engine:
        prompt = list(range(1, 1 + DECODE_PROBE_TOKENS))
        gaps = [gap for _ in range(max(2, repeats))
                for gap in engine.generate(prompt, max_new_tokens=DECODE_PROBE_TOKENS).stats.token_latency_seconds]
    return _median(gaps)


def framework_overhead(m: Measurements, compute: dict, top_k: int) -> float:
    """The all-resident decode step measured end to end, less what the profile's parts predict for it
    (per layer: attention, router and top_k one-token experts; then the LM head); never negative."""
    if m.decode_step_s is None:
        return 0.0
    expert = compute["expert_overhead_s"] + max(m.expert_bytes / compute["memory_bandwidth_bytes_per_s"],
                                                2.0 * m.expert_bytes / compute["bytes_per_param"] / compute["flops_per_s"])
    linear = {part: compute[part]["fixed_s"] + compute[part]["per_token_s"] for part in ("attention", "router",
                                                                                        "lm_head")}
    modelled = m.num_layers * (linear["attention"] + linear["router"] + top_k * expert) + linear["lm_head"]
    return max(0.0, m.decode_step_s - modelled)


def slow_link(m: Measurements) -> tuple[float, float]:
    """(latency_s, stored bytes per second) of the link out of the packed files: into the fast tier, or into
    the host tier when there is one, as the data path moved experts in a stream (the bandwidth) and one alone
    (what it takes beyond, the latency)."""
    stream = m.host_link_seconds if m.host_link_seconds is not None else m.link_seconds
    return fit_latency_bandwidth(m.expert_bytes, stream, max(m.link_alone_s, stream))[0], m.expert_bytes / stream


def expert_roofline(m: Measurements) -> dict:
    """The roofline ``overhead + max(bytes / memory bandwidth, 2 P n / flops)`` fitted to the measured expert:
    the memory term from the streaming read (converted to stored bytes, the simulator's unit), the slope of
    time over tokens as the FLOP rate, the intercept as the overhead. A roofline rather than a linear cost so
    that the profile scales with the expert size of whatever trace it simulates."""
    stored_itemsize = m.expert_bytes / m.expert_params
    compute_itemsize = 4 if m.compute_dtype == "float32" else stored_itemsize
    memory_bandwidth = m.memory_bandwidth * stored_itemsize / compute_itemsize
    memory_s = m.expert_bytes / memory_bandwidth
    tokens = sorted(m.expert_seconds)
    seconds = [m.expert_seconds[n] for n in tokens]
    _, per_token = fit_linear_cost(tokens, seconds)
    compute_bound = [n for n in tokens if per_token * n >= memory_s]
    if len(compute_bound) >= 2:  # the slope where the FLOPs, not the weights' bytes, set the time
        _, per_token = fit_linear_cost(compute_bound, [m.expert_seconds[n] for n in compute_bound])
    per_token = max(per_token, 1e-12)  # flat within noise: a rate too high to matter, still finite
    overhead = max(0.0, _median([t - max(memory_s, per_token * n) for n, t in zip(tokens, seconds)]))
    return {"flops_per_s": 2.0 * m.expert_params / per_token, "memory_bandwidth_bytes_per_s": memory_bandwidth,
            "expert_overhead_s": overhead, "bytes_per_param": stored_itemsize}


def _sources(m: Measurements, link_latency: float, link_bandwidth: float) -> list[str]:
    cache = ("page cache bypassed (posix_fadvise DONTNEED before every read)" if m.bypass_page_cache
             else "page cache kept (reads may come from RAM, not the device)")
    sources = [
        f"measured by `moe-offload hardware measure` on {m.date}: {platform.system()} {platform.machine()}, "
        f"{m.device_name}, torch {_torch_version()} with {m.threads} threads, load average "
        f"{os.getloadavg()[0]:.2f} (other work on the machine inflates every time), medians of {m.repeats} "
        f"repeats, {m.elapsed_s:.1f} s in all",
        f"model: {m.model_name} ({m.model_type}, {m.num_layers} MoE layers, experts of {m.expert_params:,} "
        f"parameters, {m.expert_bytes:,} bytes in {m.stored_dtype}); compute in {m.compute_dtype} on {m.device}",
        f"the data path (runtime/datapath.py ExpertMover, {m.readers} reader threads, chunked reads, SHA-256 on "
        f"the first read then xxHash3, " + ("pinned ring + copy stream" if m.device == "cuda" else
                                           f"conversion to {m.compute_dtype}") + f"), {cache}: {m.files_sampled} of "
        f"{m.files_total} experts moved back to back {m.repeats}x, median {m.link_seconds * 1e6:.1f} us an "
        f"expert ({m.expert_bytes / m.link_seconds / 1e9:.3g} GB/s), one alone {m.link_alone_s * 1e6:.1f} us: "
        f"link {link_bandwidth / 1e9:.3g} GB/s of stored expert bytes + {link_latency * 1e6:.1f} us",
        f"raw rates in the same run: the reader pool reading experts {m.parallel_read_bandwidth / 1e9:.3g} GB/s"
        + (f", {m.compute_dtype} conversion {m.convert_bandwidth / 1e9:.3g} GB/s" if m.convert_bandwidth else ""),
    ]
    if m.device == "cuda":
        sources.append(f"host->gpu: pinned copies, latency of a 4-byte copy {m.host_to_gpu_latency_s * 1e6:.1f} us, "
                       f"bandwidth of a {max(COPY_PROBE_BYTES, m.expert_bytes) >> 20} MiB copy "
                       f"{m.host_to_gpu_bandwidth / 1e9:.3g} GB/s")
    if m.host_link_seconds is not None:
        sources.append(f"with a host tier: ssd->host is the data path into pinned host slots, "
                       f"{m.expert_bytes / m.host_link_seconds / 1e9:.3g} GB/s")
    sources += [
        "expert: the per-expert body of models/experts.py with the model's real weights at "
        + ", ".join(f"{n}: {s * 1e6:.1f} us" for n, s in sorted(m.expert_seconds.items()))
        + f" tokens; roofline slope -> flops_per_s, intercept -> expert_overhead_s; memory bandwidth from a "
          f"streaming sum over {MEMORY_PROBE_BYTES[m.device] >> 20} MiB: {m.memory_bandwidth / 1e9:.3g} GB/s of "
          f"{m.compute_dtype}",
        "attention, router, lm_head: the packed model's skeleton (routed experts stubbed out) run on n = "
        + ", ".join(str(n) for n in TOKEN_COUNTS)
        + " tokens of prefill without a KV cache, modules timed with hooks; attention is each decoder layer's "
          "time less its router and experts, per MoE layer; lm_head is everything outside the decoder layers "
          "(embedding, final norm, LM head); least-squares lines fixed_s + per_token_s * n. These costs are "
          "this model's: another model's trace needs its own measurement",
        "capacities: " + "; ".join(f"{tier} {capacity_text(size)}, {m.capacity_notes[tier]}"
                                   for tier, size in m.capacities.items()),
    ]
    return sources


def _torch_version() -> str:
    import torch

    return torch.__version__


def profile_dict(m: Measurements, name: str = "measured") -> dict:
    """The profile of the measurements, in the structure HardwareProfile.from_dict reads (as a TOML file
    holds it), its numbers rounded to SIGNIFICANT_DIGITS."""
    link_latency, link_bandwidth = slow_link(m)
    tiers = [{"name": tier, "capacity_bytes": capacity_text(size)} for tier, size in m.capacities.items()]
    names = [tier["name"] for tier in tiers]
    links = []
    if "host" in names and names[0] == "gpu":
        links.append({"from": "host", "to": "gpu", "bandwidth_bytes_per_s": _round(m.host_to_gpu_bandwidth),
                      "latency_s": _round(m.host_to_gpu_latency_s)})
    links.append({"from": "ssd", "to": names[-2], "bandwidth_bytes_per_s": _round(link_bandwidth),
                  "latency_s": _round(link_latency)})
    compute = {key: _round(value) for key, value in expert_roofline(m).items()}
    for part in ("attention", "router", "lm_head"):
        tokens = sorted(m.non_expert_seconds[part])
        fixed, per_token = fit_linear_cost(tokens, [m.non_expert_seconds[part][n] for n in tokens])
        compute[part] = {"fixed_s": _round(fixed), "per_token_s": _round(per_token)}
    overhead = framework_overhead(m, compute, read_manifest(m.packed_dir, check_files=False).top_k)
    compute["attention"]["fixed_s"] = _round(compute["attention"]["fixed_s"] + overhead / m.num_layers)
    fast = "GPU" if m.device == "cuda" else "RAM (float32 experts)"
    sources = _sources(m, link_latency, link_bandwidth)
    if m.decode_step_s is not None:
        sources.append(f"framework overhead: one all-resident decode step of the runtime took "
                       f"{m.decode_step_s * 1e3:.2f} ms end to end (OffloadEngine, preloaded, median of "
                       f"{max(2, m.repeats)} x {DECODE_PROBE_TOKENS} tokens); the {overhead * 1e3:.2f} ms the "
                       "parts above do not explain (generate loop, hooks, Python) is spread over the "
                       f"{m.num_layers} layers: added to attention.fixed_s")
    return {"name": name,
            "description": f"measured on {m.date[:10]}: {m.device_name}, experts computed in {fast}, read from "
                           f"the expert files of a packed {m.model_type} model",
            "sources": sources,
            "tiers": tiers, "links": links, "compute": compute}


def measure_hardware(packed_dir, *, repeats: int = 5, bypass_page_cache: bool = True, device=None,
                     name: str = "measured", threads: int | None = None, model_name: str | None = None,
                     readers: int | None = None, host_budget=None) -> dict:
    """Micro-benchmark this machine on the packed model in ``packed_dir`` and return its hardware profile as
    the dict HardwareProfile.from_dict accepts (see the module docstring for what is measured)."""
    return profile_dict(measure(packed_dir, repeats=repeats, bypass_page_cache=bypass_page_cache, device=device,
                                threads=threads, model_name=model_name, readers=readers,
                                host_budget=host_budget), name)
