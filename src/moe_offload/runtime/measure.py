"""Measure this machine for the timed simulator: a hardware profile from micro-benchmarks on a packed model.

What the runtime (runtime/engine.py) does with an expert, timed piece by piece on the real files and shapes:

- the slow tier ``ssd``: every expert file (or an even sample of them) read with ``ExpertStore.read_bytes``,
  optionally after dropping the file from the page cache, so the numbers are the device's, not RAM's;
- what turns read bytes into compute-ready tensors: the SHA-256 check, ``safetensors.torch.load`` and, on a
  CPU, the conversion to float32 (the fast tier holds float32 there); with CUDA, pinning for the host tier
  and the pinned host -> GPU copy;
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

The tiers follow the presets' names (hardware/presets): ``gpu``, ``host``, ``ssd``, fastest first. Without
CUDA the fast tier is host RAM holding float32 experts, so the profile is ``host`` + ``ssd`` with one link
``ssd->host`` that carries the read and the conversion; with CUDA it is ``gpu`` + ``host`` + ``ssd`` with the
links ``host->gpu`` and ``ssd->host``, as in the presets. The simulator charges every transfer and every
memory term in the trace's stored expert bytes, so every rate here is in stored bytes per second.

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
    expert_file_bytes: int          # one expert file, header included (what a read moves)
    expert_bytes: int               # one expert's tensors in the stored dtype (what the simulator charges)
    expert_params: int
    files_sampled: int
    files_total: int
    bypass_page_cache: bool
    repeats: int
    read_median_s: float            # one whole file
    read_latency_s: float           # open + 1-byte read + close
    read_bandwidth: float           # file bytes per second after the latency
    convert_median_s: float         # checksum + safetensors load + dtype/pin, per expert
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


def _probe_latency(path: Path, bypass_page_cache: bool) -> float:
    """Seconds to open a file, read its first byte and close it: what a read costs before bytes flow."""
    started = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        if bypass_page_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.pread(fd, 1, 0)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def fit_latency_bandwidth(sizes, seconds, probe_latency_s: float) -> tuple[float, float]:
    """(latency_s, bytes per second) such that ``latency + size / bandwidth`` fits the timed reads.

    Files of different sizes: the least-squares line of time on size. Files of one size (every expert of a
    model has the same shapes) cannot separate the two: the latency is the probed 1-byte read and the rest
    of the median read is the bytes flowing; the latency is capped at half the read so that noise in the
    probe never leaves no time for the bytes."""
    if len(set(sizes)) > 1:
        latency, per_byte = fit_line(sizes, seconds)
        if latency >= 0 and per_byte > 0:
            return latency, 1.0 / per_byte
    size, median = _median(sizes), _median(seconds)
    latency = min(probe_latency_s, median / 2)
    return latency, size / (median - latency)


def measure_reads(manifest: Manifest, keys, repeats: int, bypass_page_cache: bool):
    """(median read s, latency s, bandwidth B/s, file bytes) of whole expert files through ExpertStore, without
    the checksum (timed apart, with the conversion)."""
    store = ExpertStore(manifest, verify=False, bypass_page_cache=bypass_page_cache)
    bypass = store.bypass_page_cache  # False where posix_fadvise does not exist
    sizes, seconds, probes = [], [], []
    for _ in range(repeats):
        for layer, expert in keys:
            started = time.perf_counter()
            data = store.read_bytes(layer, expert)
            seconds.append(time.perf_counter() - started)
            sizes.append(len(data))
            probes.append(_probe_latency(manifest.expert_path(layer, expert), bypass))
    latency, bandwidth = fit_latency_bandwidth(sizes, seconds, _median(probes))
    return _median(seconds), latency, bandwidth, int(_median(sizes))


def measure_conversion(manifest: Manifest, keys, repeats: int, device, compute_dtype) -> float:
    """Median seconds from an expert's bytes in memory to the tensors the next tier holds, as the engine's
    link worker makes them: SHA-256 check, safetensors load, then float32 on a CPU, pinned memory in front of
    a GPU (the host tier keeps the stored dtype there)."""
    import hashlib

    from safetensors.torch import load

    store = ExpertStore(manifest, verify=False)
    blobs = [(store.read_bytes(*key), manifest.experts[key].sha256) for key in keys[:MIN_SAMPLED_FILES]]

    def convert(data: bytes, digest: str) -> None:
        if hashlib.sha256(data).hexdigest() != digest:
            raise ConfigError(f"{manifest.directory}: an expert file changed while it was measured")
        tensors = load(data)
        if device.type == "cuda":
            tensors = {name: t.pin_memory() for name, t in tensors.items()}
        else:
            tensors = {name: t.to(dtype=compute_dtype) for name, t in tensors.items()}

    samples = []
    for _ in range(repeats):
        for data, digest in blobs:
            started = time.perf_counter()
            convert(data, digest)
            samples.append(time.perf_counter() - started)
    return _median(samples)


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


def capacities(packed_dir: Path, device, stored_itemsize: int, compute_itemsize: int):
    """(tier -> bytes, tier -> how it was found). Capacities are in stored expert bytes, the simulator's unit:
    a CPU's fast tier holds float32 copies, so its RAM holds fewer stored bytes than its size."""
    import torch

    ram = _available_ram()
    sizes, notes = {}, {}
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        sizes["gpu"] = free
        notes["gpu"] = "free GPU memory at measurement time"
        sizes["host"] = ram
        notes["host"] = "RAM available at measurement time (MemAvailable)"
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
            model_name: str | None = None) -> Measurements:
    """Run every micro-benchmark on the packed model in ``packed_dir`` (see the module docstring).
    ``threads``: torch's CPU threads while measuring (default: as they are, which is what the runtime uses);
    restored afterwards. ``model_name``: how the profile's sources name the model (default: the directory)."""
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
        return _measure(packed_dir, repeats, bypass_page_cache, device, max_files, model_name)
    finally:
        torch.set_num_threads(before)


def _measure(packed_dir, repeats: int, bypass_page_cache: bool, device, max_files: int,
             model_name: str | None) -> Measurements:
    import torch

    from moe_offload.models import quiet_transformers

    started = time.perf_counter()
    quiet_transformers()
    manifest = read_manifest(packed_dir)
    device = torch.device(device) if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device}: measured profiles exist for cpu and cuda only")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device}: this torch sees no CUDA device")
    stored = getattr(torch, manifest.dtype)
    compute_dtype = torch.float32 if device.type == "cpu" else stored  # as OffloadEngine computes
    keys = sample_experts(manifest, max_files)
    bypass = bypass_page_cache and hasattr(os, "posix_fadvise")

    read_median, read_latency, read_bandwidth, file_bytes = measure_reads(manifest, keys, repeats, bypass)
    convert = measure_conversion(manifest, keys, repeats, device, compute_dtype)
    h2d_latency = h2d_bandwidth = None
    if device.type == "cuda":
        h2d_latency, h2d_bandwidth = measure_host_to_gpu(device, manifest.expert_bytes, repeats)
    memory_bandwidth = measure_memory_bandwidth(device, repeats)

    model, adapter, _ = load_skeleton(manifest, device, compute_dtype, verify=False)
    tensors = ExpertStore(manifest).read_tensors(*keys[0])
    expert_seconds = measure_expert_compute(adapter.experts(0), tensors, device, compute_dtype, repeats)
    non_expert = measure_non_expert(model, adapter, device, repeats)
    del model
    decode_step = measure_decode_step(Path(packed_dir), device, repeats)
    sizes, notes = capacities(Path(packed_dir), device, stored.itemsize, compute_dtype.itemsize)

    params = sum(t.numel() for t in tensors.values())
    return Measurements(
        device=device.type, device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        packed_dir=Path(packed_dir).resolve(), model_name=model_name or str(Path(packed_dir).resolve()),
        model_type=manifest.model_type, stored_dtype=manifest.dtype,
        compute_dtype=str(compute_dtype).removeprefix("torch."), expert_file_bytes=file_bytes,
        expert_bytes=manifest.expert_bytes, expert_params=params, files_sampled=len(keys),
        files_total=len(manifest.experts), bypass_page_cache=bypass, repeats=repeats, read_median_s=read_median,
        read_latency_s=read_latency, read_bandwidth=read_bandwidth, convert_median_s=convert,
        host_to_gpu_latency_s=h2d_latency, host_to_gpu_bandwidth=h2d_bandwidth, memory_bandwidth=memory_bandwidth,
        expert_seconds=expert_seconds, non_expert_seconds=non_expert, num_layers=manifest.num_layers,
        capacities=sizes, capacity_notes=notes, threads=torch.get_num_threads(), decode_step_s=decode_step,
        elapsed_s=time.perf_counter() - started)


DECODE_PROBE_TOKENS = 16


def measure_decode_step(packed_dir: Path, device, repeats: int) -> float:
    """Median time per output token of the runtime with every expert preloaded (greedy, a fixed 16-token
    prompt, 16 new tokens): the all-resident TPOT the simulator's costs must add up to."""
    from moe_offload.runtime.engine import OffloadEngine

    with OffloadEngine(packed_dir, fast_budget="100%", preload=True, device=device) as engine:
        prompt = list(range(1, 1 + DECODE_PROBE_TOKENS))
        tpots = [engine.generate(prompt, max_new_tokens=DECODE_PROBE_TOKENS).stats.tpot_seconds
                 for _ in range(max(2, repeats))]
    return _median([t for t in tpots if t is not None])


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
    """(latency_s, stored bytes per second) of ssd -> host: the read's latency, then the file's bytes and
    the conversion, both charged per byte (one file size cannot tell a conversion's fixed cost from its
    per-byte cost). The file is a little larger than the expert (the safetensors header): the time is what
    the file costs, the rate is in the expert bytes the simulator charges."""
    flowing = max(m.read_median_s - m.read_latency_s, 0.0) + m.convert_median_s
    return m.read_latency_s, m.expert_bytes / max(flowing, 1e-9)  # never a zero time for the bytes


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
        f"ssd: {m.files_sampled} of {m.files_total} expert files ({m.expert_file_bytes:,} bytes each) read "
        f"{m.repeats}x with ExpertStore.read_bytes, {cache}: median {m.read_median_s * 1e6:.1f} us a file, "
        f"latency {m.read_latency_s * 1e6:.1f} us (open + 1-byte read + close), "
        f"{m.read_bandwidth / 1e9:.3g} GB/s after it",
        f"ssd->host also converts: SHA-256 check + safetensors load + "
        f"{'pinning' if m.device == 'cuda' else f'{m.compute_dtype} conversion'}, median "
        f"{m.convert_median_s * 1e6:.1f} us an expert, charged per byte: link {link_bandwidth / 1e9:.3g} GB/s "
        f"of stored expert bytes + {link_latency * 1e6:.1f} us",
    ]
    if m.device == "cuda":
        sources.append(f"host->gpu: pinned copies, latency of a 4-byte copy {m.host_to_gpu_latency_s * 1e6:.1f} us, "
                       f"bandwidth of a {max(COPY_PROBE_BYTES, m.expert_bytes) >> 20} MiB copy "
                       f"{m.host_to_gpu_bandwidth / 1e9:.3g} GB/s")
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
    links = []
    if m.device == "cuda":
        links.append({"from": "host", "to": "gpu", "bandwidth_bytes_per_s": _round(m.host_to_gpu_bandwidth),
                      "latency_s": _round(m.host_to_gpu_latency_s)})
    links.append({"from": "ssd", "to": "host", "bandwidth_bytes_per_s": _round(link_bandwidth),
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
                     name: str = "measured", threads: int | None = None, model_name: str | None = None) -> dict:
    """Micro-benchmark this machine on the packed model in ``packed_dir`` and return its hardware profile as
    the dict HardwareProfile.from_dict accepts (see the module docstring for what is measured)."""
    return profile_dict(measure(packed_dir, repeats=repeats, bypass_page_cache=bypass_page_cache, device=device,
                                threads=threads, model_name=model_name), name)


# ---------------------------------------------------------------------------------------------------- TOML out
def _toml_string(text: str) -> str:
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\u{ord(char):04X}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            raise ValueError("TOML profiles hold no NaN")
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value != 0 and not 1e-3 <= abs(value) < 1e5:  # 1.567e+08, as the presets write rates, not 156700000.0
            import numpy as np

            return np.format_float_scientific(value, unique=True, trim="-")  # shortest text that reads back exact
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{key} = {_toml_value(v)}" for key, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() and key.isascii() else _toml_string(key)


def profile_toml(profile: dict, header: str = "") -> str:
    """The profile dict as TOML in the presets' layout: top-level keys, ``sources`` one per line, then the
    [[tiers]], [[links]] and [compute] tables (tomllib only reads, and this structure is all a profile has)."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for key, value in profile.items():
        if key in ("tiers", "links", "compute"):
            continue
        if key == "sources":
            lines += ["sources = ["] + [f"  {_toml_string(s)}," for s in value] + ["]"]
        else:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for array in ("tiers", "links"):
        for table in profile.get(array, []):
            lines += ["", f"[[{array}]]"] + [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()]
    if "compute" in profile:
        lines += ["", "[compute]"] + [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in profile["compute"].items()]
    return "\n".join(lines) + "\n"


def write_profile(profile: dict, path, header: str = "") -> Path:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(profile_toml(profile, header), encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write the profile: {exc.strerror or exc}") from None
    return path
