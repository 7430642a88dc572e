"""Measure this machine for the timed simulator: a hardware profile from micro-benchmarks on a packed model.

What the runtime (runtime/engine.py) does with an expert, timed piece by piece on the real files and shapes:

- the link from the packed files into the fast tier, timed through the runtime's own data path
  (runtime/mover.py ``ExpertMover``: the reader pool's chunked reads, the checksums, the conversion to
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
the rest of an iteration, a decode step), forms.py (the expert dtypes, compute dtypes and forms),
stability.py (spread, load, peak), measurements.py (the raw numbers, the tiers' capacities), profile.py (the
profile they all make); here the measurement run that fills a Measurements.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from pathlib import Path

from moe_offload import values
from moe_offload.errors import ConfigError
from moe_offload.models import quiet_transformers
from moe_offload.runtime.engine_setup import resolve_device
from moe_offload.runtime.measure.compute import (TOKEN_COUNTS, measure_decode_step, measure_expert_compute,
                                                 measure_non_expert)
from moe_offload.runtime.measure.forms import measure_forms, quantized_weights, runtime_choices
from moe_offload.runtime.measure.measurements import Measurements, capacities
from moe_offload.runtime.measure.profile import expert_roofline, measurement_notes, profile_dict, sharing
from moe_offload.runtime.measure.stability import load_average, peak_flops
from moe_offload.runtime.measure.timing import fit_linear_cost
from moe_offload.runtime.measure.transfers import (MAX_SAMPLED_FILES, MIN_SAMPLED_FILES, fit_latency_bandwidth,
                                                   measure_host_to_gpu, measure_link, measure_memory_bandwidth,
                                                   measure_pinned_copy, measure_raw_rates, sample_experts, streaming)
from moe_offload.runtime.packing import read_manifest
from moe_offload.runtime.skeleton import load_skeleton
from moe_offload.runtime.storage import ExpertStore, default_readers

__all__ = ["Measurements", "measure", "measure_hardware", "profile_dict", "expert_roofline", "measurement_notes",
           "sharing", "capacities", "TOKEN_COUNTS",
           "fit_latency_bandwidth", "fit_linear_cost", "measure_host_to_gpu", "measure_pinned_copy",
           "measure_raw_rates", "sample_experts"]


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
        host_bytes = values.budget_bytes(host_budget, manifest.expert_bytes * len(manifest.experts), "--host-budget",
                                         expert_bytes=manifest.expert_bytes)

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


def measure_hardware(packed_dir, *, repeats: int = 5, bypass_page_cache: bool = True, device=None,
                     name: str = "measured", threads: int | None = None, model_name: str | None = None,
                     readers: int | None = None, host_budget=None) -> dict:
    """Micro-benchmark this machine on the packed model in ``packed_dir`` and return its hardware profile as
    the dict HardwareProfile.from_dict accepts (see the module docstring for what is measured)."""
    return profile_dict(measure(packed_dir, repeats=repeats, bypass_page_cache=bypass_page_cache, device=device,
                                threads=threads, model_name=model_name, readers=readers,
                                host_budget=host_budget), name)
