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
- the same expert stored as float16, int8 and int4, in each compute dtype and form the fast tier can hold it
  in (forms.py): the profile's ``[runtime]`` choices of ``--dtype`` and ``--expert-compute`` per expert dtype;
- the same expert on the host CPU as the runtime computes a bypassed one (models/host_experts.py: from the
  host tier's copy in the stored dtype, converted at every call to the dtype the runtime computes in with
  this profile: its ``[runtime]`` choice for the stored dtype, since the host computes in the dtype of the
  hidden states; float16 to bfloat16 alone costs a float32 expert's whole time), with the host memory's
  streaming read beside it: the profile's ``[host]`` roofline, what a bypassed expert costs (a static
  placement's, or Fiddler's fetch-or-compute rule's). On a CPU machine the host is the processor that
  computes the fast tier's experts too: the profile says so (``[host] on_compute_device``), and the timed
  simulator then runs the host's experts on the compute stream, after the layer's resident ones, with no
  hidden states crossing a link, as the runtime does;
- the rest of an iteration (attention, routers, LM head) by running the packed model's skeleton with the
  experts stubbed out and timing its modules with hooks;
- one whole decode step of the runtime with every expert resident (OffloadEngine, preloaded, greedy
  generate): what the parts above do not explain (transformers' generate loop, the hooks, Python between the
  kernels) is framework overhead per token. It is spread over the layers (added to the attention's fixed
  cost, which the simulator charges once per layer), because that is where the Python runs: between one
  router and the next, which is the window a prefetch has. Without it the simulator would predict a decode
  step the runtime never achieves, and prefetch windows shorter than the runtime's;
- the same decode step while a thread streams experts through the data path, and that stream's rate while
  the decode runs: how much compute and transfers slow each other down when they share the machine (on a
  CPU they share the cores, and everywhere the Python of both shares the interpreter's lock). The ratios to
  the idle step and the idle stream are the profile's ``compute.slowdown_while_loading`` and the slow link's
  ``slowdown_while_computing``, which the timed simulator applies while both run. With a host tier the
  stream goes from the files to the GPU, and its slowdown is given to the ``ssd->host`` link.

The tiers are the runtime's: the fast tier (``gpu`` with CUDA, else ``host``: RAM holding compute-ready
experts) and ``ssd`` (the packed files), with one link ``ssd->gpu`` / ``ssd->host`` that carries what the
data path does, since without a host tier the runtime reads every expert from the files straight into the
fast tier. With ``host_budget`` (CUDA only) the profile has the runtime's three tiers ``gpu``, ``host`` (of
that budget) and ``ssd``, with the links ``host->gpu`` (one pinned copy) and ``ssd->host`` (reads into
pinned host slots). The simulator charges every transfer and every memory term in the trace's stored expert
bytes, so every rate here is in stored bytes per second.

Timings are medians over ``repeats``; short operations are timed in batches of at least a few milliseconds
so that the clock's resolution does not matter. How far the repeats spread, how busy the machine was and
whether the expert's FLOP rate is above the machine's peak (then held to it) are stability.py's: the
profile's sources and the command's notes say it.

The package: timing.py (medians, fits), transfers.py (the link and the raw rates), compute.py (one expert,
the rest of an iteration, a decode step), stability.py (spread, load, peak); here the capacities, and the
profile they all make.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from moe_offload.errors import ConfigError
from moe_offload.hardware.profile import MAX_SLOWDOWN
from moe_offload.runtime.measure.compute import (DECODE_PROBE_TOKENS, TOKEN_COUNTS, measure_decode_step, measure_expert_compute,
                                                 measure_non_expert)
from moe_offload.runtime.measure.forms import forms_source, measure_forms, quantized_weights, runtime_choices
from moe_offload.runtime.measure.stability import load_average, peak_flops, stability_notes
from moe_offload.runtime.measure.timing import _round, fit_linear_cost
from moe_offload.runtime.measure.transfers import (COPY_PROBE_BYTES, MAX_SAMPLED_FILES, MEMORY_PROBE_BYTES,
                                                   MIN_SAMPLED_FILES, fit_latency_bandwidth, measure_host_to_gpu,
                                                   measure_link, measure_memory_bandwidth, measure_pinned_copy,
                                                   measure_raw_rates, sample_experts, streaming)
from moe_offload.runtime.packing import load_skeleton, read_manifest
from moe_offload.runtime.storage import ExpertStore

__all__ = ["Measurements", "measure", "measure_hardware", "profile_dict", "expert_roofline", "measurement_notes",
           "sharing", "capacities",
           "fit_latency_bandwidth", "fit_linear_cost", "measure_host_to_gpu", "measure_pinned_copy",
           "measure_raw_rates", "sample_experts"]


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
    decode_step_streaming_s: float | None = None  # the same while experts stream through the data path
    link_seconds_decoding: float | None = None  # one expert of that stream, while the decode runs
    host_expert_seconds: dict[int, float] | None = None  # tokens -> the expert on the host CPU (compute_dtype)
    host_memory_bandwidth: float | None = None  # streaming read of the host's memory
    elapsed_s: float = 0.0
    expert_deviation: dict[int, float] = field(default_factory=dict)  # tokens -> repeats' largest deviation
    link_deviation: float = 0.0     # the stream's repeats' largest deviation from their median
    load_average: float = 0.0       # the largest 1-minute load average seen while measuring
    cores: int = 1
    peak_flops: float = float("inf")  # no FLOP rate above this is possible on the device (stability.py)
    peak_flops_how: str = "not known"
    forms: dict | None = None  # expert dtype -> compute dtype -> form -> its times (forms.py)
    date: str = field(default_factory=lambda: datetime.datetime.now().astimezone().isoformat(timespec="seconds"))


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
    from moe_offload import values
    from moe_offload.runtime.engine_setup import resolve_device
    from moe_offload.runtime.storage import default_readers

    started = time.perf_counter()
    load = load_average()
    quiet_transformers()
    device = resolve_device(device)
    manifest = read_manifest(packed_dir)
    stored = getattr(torch, manifest.dtype)
    keys = sample_experts(manifest, max_files)
    bypass = bypass_page_cache and hasattr(os, "posix_fadvise")
    host_bytes = None
    if host_budget is not None:
        if device.type != "cuda":
            raise ConfigError("a host tier is measured in front of a GPU only (on a CPU the fast tier is the RAM)")
        host_bytes = values.budget_bytes(host_budget, manifest.expert_bytes * len(manifest.experts), "--host-budget")

    # The forms first: the runtime given this profile computes in its [runtime] dtype for this pack's experts
    # (OffloadEngine's default without one: float32 on a CPU, the stored dtype on a GPU), so every time below
    # is measured in that dtype, the host's expert included (a bypassed expert is computed in the dtype of the
    # hidden states, from the host tier's stored copy converted at every call).
    default_dtype = torch.float32 if device.type == "cpu" else stored
    model, adapter, _ = load_skeleton(manifest, device, default_dtype, verify=False)
    tensors = ExpertStore(manifest).read_tensors(*keys[0])
    forms = measure_forms(manifest, tensors, adapter.experts(0), device, repeats)
    compute_dtype = getattr(torch, runtime_choices(forms)["dtype"].get(manifest.expert_dtype or manifest.dtype,
                                                                       str(default_dtype).removeprefix("torch.")))
    if compute_dtype != default_dtype:
        model, adapter, _ = load_skeleton(manifest, device, compute_dtype, verify=False)
    link_s, alone_s, link_deviation = measure_link(manifest, keys, repeats, bypass, device, compute_dtype, readers)
    parallel_read, convert = measure_raw_rates(manifest, keys, repeats, bypass, readers)
    host_link_s = h2d_latency = h2d_bandwidth = None
    if device.type == "cuda":
        h2d_latency, h2d_bandwidth = measure_host_to_gpu(device, manifest.expert_bytes, repeats)
        if host_bytes is not None:
            host_link_s, *_ = measure_link(manifest, keys, repeats, bypass, torch.device("cpu"), stored, readers,
                                          pinned_host=True)
    memory_bandwidth = measure_memory_bandwidth(device, repeats)

    expert_seconds, expert_deviation = measure_expert_compute(adapter.experts(0), tensors, device, compute_dtype,
                                                              repeats, weights=quantized_weights(manifest, keys[0],
                                                                                                 device, compute_dtype))
    cpu = torch.device("cpu")
    host_expert_seconds, _ = measure_expert_compute(adapter.experts(0), tensors, cpu, compute_dtype, repeats,
                                                    weights=quantized_weights(manifest, keys[0], cpu, compute_dtype,
                                                                              host=True),
                                                    host_copy=True)
    host_memory_bandwidth = memory_bandwidth if device.type == "cpu" else measure_memory_bandwidth(cpu, repeats)
    non_expert = measure_non_expert(model, adapter, device, repeats)
    del model
    decode_step, decode_step_streaming, link_decoding = measure_decode_step(
        Path(packed_dir), device, repeats, dtype=compute_dtype, stream=functools.partial(streaming, manifest, keys, bypass, device,
                                                                    compute_dtype, readers))
    sizes, notes = capacities(Path(packed_dir), device, stored.itemsize, compute_dtype.itemsize, host_bytes)

    params = sum(t.numel() for t in tensors.values())
    peak, peak_how = peak_flops(device)
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
        decode_step_streaming_s=decode_step_streaming, link_seconds_decoding=link_decoding,
        host_expert_seconds=host_expert_seconds, host_memory_bandwidth=host_memory_bandwidth,
        elapsed_s=time.perf_counter() - started, expert_deviation=expert_deviation, link_deviation=link_deviation,
        load_average=max(load, load_average()), cores=os.cpu_count() or 1, peak_flops=peak, peak_flops_how=peak_how,
        forms=forms)


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


def sharing(m: Measurements) -> tuple[float | None, float | None]:
    """(compute's slowdown while experts stream in the background, the stream's slowdown while the decode
    runs), each within [1, MAX_SLOWDOWN]; None when the decode step was not measured with a stream."""
    if m.decode_step_s is None or m.decode_step_streaming_s is None:
        return None, None
    return (min(MAX_SLOWDOWN, max(1.0, m.decode_step_streaming_s / m.decode_step_s)),
            min(MAX_SLOWDOWN, max(1.0, m.link_seconds_decoding / m.link_seconds)))


def slow_link(m: Measurements) -> tuple[float, float]:
    """(latency_s, stored bytes per second) of the link out of the packed files: into the fast tier, or into
    the host tier when there is one, as the data path moved experts in a stream (the bandwidth) and one alone
    (what it takes beyond, the latency)."""
    stream = m.host_link_seconds if m.host_link_seconds is not None else m.link_seconds
    return fit_latency_bandwidth(m.expert_bytes, stream, max(m.link_alone_s, stream))[0], m.expert_bytes / stream


def _fitted_seconds_per_token(expert_seconds: dict[int, float], memory_s: float) -> float:
    """The slope of one expert's time over its tokens, fitted where the FLOPs, not the weights' bytes, set the
    time when two or more sizes are there, else over all sizes."""
    tokens = sorted(expert_seconds)
    _, per_token = fit_linear_cost(tokens, [expert_seconds[n] for n in tokens])
    compute_bound = [n for n in tokens if per_token * n >= memory_s]
    if len(compute_bound) >= 2:
        _, per_token = fit_linear_cost(compute_bound, [expert_seconds[n] for n in compute_bound])
    return per_token


def measurement_notes(m: Measurements) -> list[str]:
    """What makes these measurements less than facts (stability.stability_notes)."""
    stored_itemsize = m.expert_bytes / m.expert_params
    compute_itemsize = 4 if m.compute_dtype == "float32" else stored_itemsize
    memory_s = m.expert_bytes / (m.memory_bandwidth * stored_itemsize / compute_itemsize)
    slope = _fitted_seconds_per_token(m.expert_seconds, memory_s)
    fitted = 2.0 * m.expert_params / slope if slope > 0 else float("inf")
    return stability_notes(repeats=m.repeats, expert_deviation=m.expert_deviation.get(min(m.expert_seconds), 0.0),
                           link_deviation=m.link_deviation, load=m.load_average, cores=m.cores,
                           fitted_flops=fitted, peak=m.peak_flops, peak_how=m.peak_flops_how)


def expert_roofline(m: Measurements, host: bool = False) -> dict:
    """The roofline ``overhead + max(bytes / memory bandwidth, 2 P n / flops)`` fitted to the measured expert:
    the memory term from the streaming read (converted to stored bytes, the simulator's unit), the slope of
    time over tokens as the FLOP rate, and the overhead that makes the roofline pass through the one-token
    time: a decoding token is one token per expert, so TPOT is made of that point. Where one token takes less
    than the streaming read predicts (a weight that stays in a CPU's last-level cache between tokens), the
    memory bandwidth is the one-token rate instead. A roofline rather than a linear cost so that the profile
    scales with the expert size of whatever trace it simulates; between one token and the compute-bound
    sizes it is a bound, not a fit (MKL's products of 4 to 16 rows on CPU take up to twice what it says).
    ``host``: the same fit to the expert measured on the host CPU in its compute dtype (the profile's
    ``[host]``)."""
    stored_itemsize = m.expert_bytes / m.expert_params
    if host:
        expert_seconds, read = m.host_expert_seconds, m.host_memory_bandwidth
        compute_itemsize = 4 if m.compute_dtype == "float32" else 2
    else:
        expert_seconds, read = m.expert_seconds, m.memory_bandwidth
        compute_itemsize = 4 if m.compute_dtype == "float32" else stored_itemsize
    memory_bandwidth = read * stored_itemsize / compute_itemsize
    memory_s = m.expert_bytes / memory_bandwidth
    tokens = sorted(expert_seconds)
    # flat within noise, the slope would claim a rate above the machine's peak: the peak's time per token
    per_token = max(_fitted_seconds_per_token(expert_seconds, memory_s), 2.0 * m.expert_params / m.peak_flops, 1e-12)
    one = expert_seconds[tokens[0]]
    if one < max(memory_s, per_token * tokens[0]) and per_token * tokens[0] < one:
        memory_bandwidth, memory_s = m.expert_bytes / one, one
    overhead = max(0.0, one - max(memory_s, per_token * tokens[0]))
    return {"flops_per_s": 2.0 * m.expert_params / per_token, "memory_bandwidth_bytes_per_s": memory_bandwidth,
            "expert_overhead_s": overhead, "bytes_per_param": stored_itemsize}


def _sources(m: Measurements, link_latency: float, link_bandwidth: float) -> list[str]:
    cache = ("page cache bypassed (posix_fadvise DONTNEED before every read)" if m.bypass_page_cache
             else "page cache kept (reads may come from RAM, not the device)")
    sources = [
        f"measured by `moe-offload hardware measure` on {m.date}: {platform.system()} {platform.machine()}, "
        f"{m.device_name}, torch {_torch_version()} with {m.threads} threads, load average up to "
        f"{m.load_average:.2f} on {m.cores} cores (other work on the machine inflates every time), medians of "
        f"{m.repeats} repeats, {m.elapsed_s:.1f} s in all; one-token expert compute within "
        f"{m.expert_deviation.get(min(m.expert_seconds), 0.0):.0%} of its median, the data path's stream within "
        f"{m.link_deviation:.0%}; peak {m.peak_flops / 1e9:,.4g} GFLOP/s ({m.peak_flops_how}) bounds the roofline",
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
        + f" tokens; roofline: slope over the compute-bound sizes -> flops_per_s, expert_overhead_s so that it "
          f"passes through the one-token time (a decoding token's); memory bandwidth from a streaming sum over "
          f"{MEMORY_PROBE_BYTES[m.device] >> 20} MiB: {m.memory_bandwidth / 1e9:.3g} GB/s of {m.compute_dtype} "
          f"(the one-token rate where that is faster: weights that stay in the CPU's cache)",
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
    compute_slowdown, link_slowdown = sharing(m)
    if link_slowdown is not None:
        links[-1]["slowdown_while_computing"] = _round(link_slowdown)
    compute = {key: _round(value) for key, value in expert_roofline(m).items()}
    host = ({key: _round(value) for key, value in expert_roofline(m, host=True).items()}
            if m.host_expert_seconds else None)
    for part in ("attention", "router", "lm_head"):
        tokens = sorted(m.non_expert_seconds[part])
        fixed, per_token = fit_linear_cost(tokens, [m.non_expert_seconds[part][n] for n in tokens])
        compute[part] = {"fixed_s": _round(fixed), "per_token_s": _round(per_token)}
    overhead = framework_overhead(m, compute, read_manifest(m.packed_dir, check_files=False).top_k)
    compute["attention"]["fixed_s"] = _round(compute["attention"]["fixed_s"] + overhead / m.num_layers)
    if compute_slowdown is not None:
        compute["slowdown_while_loading"] = _round(compute_slowdown)
    fast = "GPU" if m.device == "cuda" else "RAM (float32 experts)"
    sources = _sources(m, link_latency, link_bandwidth)
    if m.decode_step_s is not None:
        sources.append(f"framework overhead: one all-resident decode step of the runtime took "
                       f"{m.decode_step_s * 1e3:.2f} ms end to end (OffloadEngine, preloaded, median of "
                       f"{max(2, m.repeats)} x {DECODE_PROBE_TOKENS} tokens); the {overhead * 1e3:.2f} ms the "
                       "parts above do not explain (generate loop, hooks, Python) is spread over the "
                       f"{m.num_layers} layers: added to attention.fixed_s")
    sources += [f"note: {note}" for note in measurement_notes(m)]
    if compute_slowdown is not None:
        sources.append(f"sharing: while a thread streamed experts through the data path (as the link above), "
                       f"the decode step took {m.decode_step_streaming_s * 1e3:.2f} ms: compute."
                       f"slowdown_while_loading {compute_slowdown:.3g}; while the decode ran, the stream took "
                       f"{m.link_seconds_decoding * 1e6:.1f} us an expert: the ssd link's slowdown_while_computing "
                       f"{link_slowdown:.3g} (ratios below 1 are noise, read as 1)")
    if host is not None:
        sources.append("host: the same expert on the host CPU from the host tier's stored copy, converted to "
                       f"{m.compute_dtype} at every call (as the runtime computes a bypassed expert), at "
                       + ", ".join(f"{n}: {s * 1e6:.1f} us" for n, s in sorted(m.host_expert_seconds.items()))
                       + f" tokens, host memory read {m.host_memory_bandwidth / 1e9:.3g} GB/s; the same roofline fit")
    profile = {"name": name,
               "description": f"measured on {m.date[:10]}: {m.device_name}, experts computed in {fast}, read from "
                              f"the expert files of a packed {m.model_type} model",
               "sources": sources,
               "tiers": tiers, "links": links, "compute": compute}
    if host is not None:
        if m.device == "cpu":  # the host's experts run on the cores that compute the fast tier's
            host["on_compute_device"] = True
        profile["host"] = host
    if m.forms is not None:
        profile["runtime"] = {"device": m.device, **runtime_choices(m.forms)}
        sources.append(forms_source(m.forms))
    return profile


def measure_hardware(packed_dir, *, repeats: int = 5, bypass_page_cache: bool = True, device=None,
                     name: str = "measured", threads: int | None = None, model_name: str | None = None,
                     readers: int | None = None, host_budget=None) -> dict:
    """Micro-benchmark this machine on the packed model in ``packed_dir`` and return its hardware profile as
    the dict HardwareProfile.from_dict accepts (see the module docstring for what is measured)."""
    return profile_dict(measure(packed_dir, repeats=repeats, bypass_page_cache=bypass_page_cache, device=device,
                                threads=threads, model_name=model_name, readers=readers,
                                host_budget=host_budget), name)
