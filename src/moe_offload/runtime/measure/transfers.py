"""The slow tier and the links of ``hardware measure``: experts moved through the runtime's own data path, and
the raw rates that bound it (parallel reads, pinned copies, memory bandwidth, host -> GPU)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from moe_offload.runtime.measure.timing import _median, _synchronizer, deviation, time_per_call
from moe_offload.runtime.packing import Manifest

MIN_SAMPLED_FILES = 16
MAX_SAMPLED_FILES = 64
MEMORY_PROBE_BYTES = {"cpu": 64 << 20, "cuda": 1 << 30}  # well past the caches (an H100's L2 is 50 MB)
COPY_PROBE_BYTES = 64 << 20    # a pinned host -> GPU copy this long runs at the link's rate


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
                 readers: int | None = None, pinned_host: bool = False) -> tuple[float, float, float]:
    """(seconds per expert in a stream, seconds for one expert alone, the stream's largest deviation from its
    median over the repeats: timing.deviation) through the runtime's data path from the files into a tier on
    ``device`` in ``dtype`` (``pinned_host``: a pinned host slot, as a host tier in front of a GPU); the stream
    is ``keys`` moved back to back (medians over ``repeats``), CUDA copies included (synchronised at the end)."""
    sync = _synchronizer(device)
    with _data_path(manifest, bypass_page_cache, device, dtype, readers, pinned_host) as move:
        for layer, expert in keys:  # first reads check SHA-256; the runtime's later reads check xxHash3
            move(layer, expert, 0)
        sync()
        streams, alone = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            for i, (layer, expert) in enumerate(keys):
                move(layer, expert, i % 2)
            sync()
            streams.append((time.perf_counter() - started) / len(keys))
            started = time.perf_counter()
            move(*keys[0], 0)
            sync()
            alone.append(time.perf_counter() - started)
    return _median(streams), _median(alone), deviation(streams)


@contextmanager
def _data_path(manifest: Manifest, bypass_page_cache: bool, device, dtype, readers: int | None,
               pinned_host: bool = False):
    """``move(layer, expert, slot)``: one expert through the runtime's data path (ExpertMover) into a slot of a
    two-slot tier on ``device`` in ``dtype``."""
    from moe_offload.runtime.mover import ExpertMover
    from moe_offload.runtime.storage import ExpertStore
    from moe_offload.runtime.tiers import SlotPool, Tier

    from moe_offload.runtime.expert_forms import expert_form

    store = ExpertStore(manifest, bypass_page_cache=bypass_page_cache, readers=readers)
    form = None if pinned_host else expert_form(None, manifest, device, dtype)  # quantized: the runtime's form
    if form is not None:
        pool = SlotPool(2, form.slot_elements, form.slot_dtype, device)
    else:
        pool = SlotPool(2, manifest.expert_bytes // _itemsize(manifest.dtype), dtype, device, pin=pinned_host)
    tier = Tier("fast", None, pool, manifest, device, dtype, form)
    mover = ExpertMover(store, manifest.num_experts)
    try:
        yield lambda layer, expert, slot: mover.move(layer * manifest.num_experts + expert, None, None, tier, slot)
    finally:
        store.close()


@contextmanager
def streaming(manifest: Manifest, keys, bypass_page_cache: bool, device, dtype, readers: int | None):
    """While the block runs, a thread moves ``keys`` back to back through the data path, over and over, as
    measure_link's stream does; yields a list that receives the seconds per expert of each whole pass (the
    first pass, and one the block's end cuts short, are left out). An error in the thread is raised here."""
    stop, per_expert, failed = threading.Event(), [], []
    sync = _synchronizer(device)

    def run():
        try:
            with _data_path(manifest, bypass_page_cache, device, dtype, readers) as move:
                passes = 0
                while not stop.is_set():
                    started = time.perf_counter()
                    for i, (layer, expert) in enumerate(keys):
                        if stop.is_set():
                            return
                        move(layer, expert, i % 2)
                    sync()
                    if passes:
                        per_expert.append((time.perf_counter() - started) / len(keys))
                    passes += 1
        except BaseException as exc:  # noqa: BLE001 - re-raised in the measuring thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="moe-offload measure stream", daemon=True)
    thread.start()
    try:
        yield per_expert
    finally:
        stop.set()
        thread.join()
    if failed:
        raise failed[0]


def measure_raw_rates(manifest: Manifest, keys, repeats: int, bypass_page_cache: bool,
                      readers: int | None = None) -> tuple[float, float]:
    """(parallel read, conversion) in stored bytes per second: the reader pool reading experts into a buffer
    that is already mapped (no checksum, no conversion), and a float32 copy of the experts' float16 (or other
    stored dtype) elements from memory by as many threads as the pool has readers. The bounds of the CPU data
    path: every expert is read, then converted."""
    import torch

    from moe_offload.runtime.cpu_threads import copy_serially
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
            list(pool.map(lambda pair: copy_serially(*pair), parts))  # as the readers convert (cpu_threads)
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
