"""The hardware profile a set of :class:`~moe_offload.runtime.measure.measurements.Measurements` makes: the
links fitted to the data path's stream and its one-expert time, the expert's roofline, the non-expert costs,
the framework overhead spread over the layers, the sharing slowdowns, and the sources that say how each number
was measured (the package docstring says what is measured)."""

from __future__ import annotations

import platform

from moe_offload.hardware.profile import MAX_SLOWDOWN
from moe_offload.runtime.measure.compute import DECODE_PROBE_TOKENS, TOKEN_COUNTS
from moe_offload.runtime.measure.forms import forms_source, runtime_choices
from moe_offload.runtime.measure.measurements import Measurements, capacity_text
from moe_offload.runtime.measure.stability import stability_notes
from moe_offload.runtime.measure.timing import _round, fit_linear_cost
from moe_offload.runtime.measure.transfers import COPY_PROBE_BYTES, MEMORY_PROBE_BYTES, fit_latency_bandwidth
from moe_offload.runtime.packing import read_manifest


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
        f"the data path (runtime/mover.py ExpertMover, {m.readers} reader threads, chunked reads, SHA-256 on "
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
