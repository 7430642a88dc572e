"""What ``hardware measure`` found (:class:`Measurements`: the raw numbers behind a profile) and the capacities of
the runtime's tiers on this machine, in the stored expert bytes the simulator counts."""

from __future__ import annotations

import datetime
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path


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
