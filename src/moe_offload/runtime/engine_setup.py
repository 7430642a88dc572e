"""The engine's set-up (runtime/engine.py): its device and compute dtype, the sizes of its tiers, its tiers,
MoEpic's split, the prefetcher's link budget, the replayed trace and the prefetcher.

Each part is made once, while ``OffloadEngine`` is constructed, from the manifest of the packed model and
the engine's Plan (plan/plan.py, checked by make_plan); what only the model can say (whether a budget holds a
layer's experts, whether a split fits) raises a ConfigError naming the option here, before the model loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_offload import values
from moe_offload.errors import ConfigError
from moe_offload.hardware.choices import COMPUTE_DTYPES
from moe_offload.values import format_bytes
from moe_offload.policies import policy_info
from moe_offload.prefetch import make_prefetcher, prefetcher_info
from moe_offload.runtime.tiers import SlotPool, Tier
from moe_offload.simulator.cache import ExpertCache
from moe_offload.simulator.partitioned_cache import PartitionedCache



def compute_dtype(name: str | None, device, stored):
    """The fast tier's dtype: ``name`` (COMPUTE_DTYPES), else float32 on a CPU and the stored dtype elsewhere."""
    import torch

    if name is None:
        return torch.float32 if device.type == "cpu" else stored
    if name not in COMPUTE_DTYPES:
        raise ConfigError(f"--dtype {name!r}: choose from {', '.join(COMPUTE_DTYPES)}")
    return getattr(torch, name)


@dataclass(frozen=True)
class Sizing:
    """What a plan's budgets and dtypes come to for one packed model on one device: the fast tier's dtype and
    expert form, the bytes of one expert there and of all experts in the compute dtype (what a share of the
    fast budget is of), the fast budget in bytes, and the whole experts each tier holds."""

    compute_dtype: object  # a torch.dtype
    expert_form: object  # runtime/expert_forms.py's form of quantized experts, or None
    expert_bytes: int
    total_expert_bytes: int
    fast_budget_bytes: int
    fast_slots: int
    host_slots: int


def size_tiers(plan, manifest, spec, device) -> Sizing:
    """The Sizing of ``plan`` for ``manifest``'s experts on ``device``, checked against the model: the fast tier
    must hold a layer's top-k experts (one per layer for a partitioned policy), the host tier one expert (a
    placing run's, a layer's top-k, which it may compute there at once). Where ``dtype`` or ``expert_compute``
    is None, the measured profile ``plan.hardware`` chooses (its ``[runtime]`` table for the pack's experts)."""
    import torch

    from moe_offload.runtime.expert_forms import expert_form, profile_choices

    m = manifest
    info = policy_info(plan.policy)
    if info.offline:
        raise ConfigError(f"policy {plan.policy!r} needs the future (next use of every expert), which a running "
                          "engine does not know; use it in `moe-offload simulate`")
    if m.quantized and plan.split:
        raise ConfigError(f"{m.directory}: {m.expert_dtype} experts: MoEpic's split does not read quantized "
                          "experts yet (docs/guides/checkpoints.md says why)")
    measured_dtype, measured_form = profile_choices(plan.hardware, m, device)  # what the plan does not say
    if plan.dtype is not None and plan.dtype != measured_dtype:
        measured_form = None  # the form was measured fastest in its own dtype, not in this one
    dtype = compute_dtype(plan.dtype or measured_dtype, device, getattr(torch, m.dtype))
    elements = sum(math.prod(tensor.shape) for tensor in m.tensors)
    # A share of the budget is of all experts in the compute dtype whatever the stored dtype, so "25%" is the same
    # memory for every pack of a model; quantized experts take the bytes of their form in the fast tier
    # (runtime/expert_forms.py: per use and the kernel about the stored bytes), so more fit in it.
    form = expert_form(plan.expert_compute or measured_form, m, device, dtype)
    expert_bytes = form.slot_bytes if form is not None else elements * dtype.itemsize
    experts = m.num_layers * m.num_experts
    total = experts * elements * dtype.itemsize
    budget = plan.fast_budget_bytes(total, expert_bytes, experts)
    fast_slots = min(budget // expert_bytes, experts)
    places = info.policy.places_or_bypasses or plan.fetch_or_compute
    if fast_slots < m.top_k and not plan.split and not info.policy.static:  # static: the rest on the host
        raise ConfigError(f"fast budget {plan.fast_budget} cannot hold one layer's top-{m.top_k} experts "
                          f"({format_bytes(m.top_k * expert_bytes)}, {format_bytes(expert_bytes)} each)")
    if info.partitioned and not plan.split and fast_slots < m.num_layers:  # a layer with no slot waits forever
        raise ConfigError(f"policy {plan.policy!r} splits the fast tier among the {m.num_layers} layers: "
                          f"{fast_slots} experts leave a layer without one; give at least {m.num_layers} "
                          f"({format_bytes(m.num_layers * expert_bytes)})")
    whole_layers = info.whole_layers(plan.policy_options, spec)
    if whole_layers and plan.split:
        raise ConfigError(f"{plan.policy}.whole_layers: MoEpic's split keeps its own per-layer tops; give one or the "
                          "other")
    if whole_layers:  # the whole layers and a slot for each other layer, or a clear refusal before any loading
        PartitionedCache.capacities(fast_slots, m.num_layers, m.num_experts, whole_layers)
    host_slots = plan.host_experts(m.expert_bytes, experts)
    if plan.host_budget is not None and host_slots < 1:
        raise ConfigError(f"host budget {plan.host_budget} cannot hold one expert ({format_bytes(m.expert_bytes)})")
    if places and plan.host_budget is not None and host_slots < m.top_k:
        raise ConfigError(f"host budget {plan.host_budget} cannot hold a layer's top-{m.top_k} experts "
                          f"({format_bytes(m.expert_bytes)} each), which {plan.policy!r} computes there")
    return Sizing(dtype, form, expert_bytes, total, budget, fast_slots, host_slots)


def resolve_device(device):
    """The torch.device of ``device`` (a name or a torch.device, checked by values.device: cpu, or cuda[:N] with
    CUDA present); None is cuda where present, else cpu."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(values.device(str(device) if isinstance(device, torch.device) else device, "device"))


def make_tiers(manifest, spec, partitioned: bool, make, fast_slots: int, host_slots: int, device, dtype,
               compute_expert_bytes: int, form=None, whole_layers=()) -> list[Tier]:
    """The fast tier (and the host tier) of an unsplit run: ``fast_slots`` experts of ``compute_expert_bytes``
    computing in ``dtype`` on ``device``, each partition's policy from ``make`` (``whole_layers``: a -dist
    cache's layers held whole); quantized experts in ``form`` (runtime/expert_forms.py)."""
    import torch

    m = manifest
    stored = getattr(torch, m.dtype)
    fast_bytes = fast_slots * compute_expert_bytes
    fast_cache = (PartitionedCache(fast_bytes, m.num_layers, make, m.num_experts, slot_size=compute_expert_bytes,
                                   whole_layers=whole_layers)
                  if partitioned else ExpertCache(fast_bytes, make()))
    elements = m.expert_bytes // stored.itemsize
    fast_pool = SlotPool(fast_slots, form.slot_elements, form.slot_dtype, device) if form is not None else \
        SlotPool(fast_slots, elements, dtype, device)
    return [Tier("fast", fast_cache, fast_pool, m, device, dtype, form)] + host_tier(manifest, spec, host_slots,
                                                                                    device, form)


def host_tier(manifest, spec, host_slots: int, device, form=None) -> list[Tier]:
    """The host tier of ``host_slots`` experts as stored (pinned when ``device`` is CUDA), LRU; none for 0.
    Quantized experts' slots hold their bytes; the host computes with them in the fast tier's ``form``."""
    import torch

    from moe_offload.runtime.expert_forms import StoredCopy

    if not host_slots:
        return []
    m, cpu = manifest, torch.device("cpu")
    stored = torch.uint8 if m.quantized else getattr(torch, m.dtype)
    return [Tier("host", ExpertCache(host_slots * m.expert_bytes, policy_info("lru").policy(spec)),
                 SlotPool(host_slots, m.expert_bytes // stored.itemsize, stored, cpu,
                          pin=device.type == "cuda"), m, cpu, stored, form and StoredCopy(form))]


def read_split(plan, sizing: Sizing, manifest, spec):
    """((configuration, its name), its online loop or None) of a split run, checked against the model; (None,
    None) without one."""
    if not plan.split:
        return None, None
    from moe_offload.runtime.split_online import split_plan

    return split_plan(plan.split_config, plan.reconfiguration, plan.hardware, manifest, spec, sizing.expert_bytes,
                      sizing.fast_budget_bytes)


def link_budget(profile, manifest):
    """What the link into the fast tier carries per layer on the hardware ``profile`` (the plan's), for the stored
    experts the link moves: the budget ``simulate --timed`` gives the prefetcher on the same profile
    (prefetch/budget.py), so MoEpic's Y is the same in both."""
    from moe_offload.prefetch.budget import budget_from_hardware

    m = manifest
    return budget_from_hardware(profile, m.expert_bytes, m.num_layers, m.top_k)


def read_replay(replay):
    """The trace to replay: ``replay`` itself (a Trace), read from its path, or None."""
    if replay is None:
        return None
    from moe_offload.trace.format import Trace, read_trace

    return replay if isinstance(replay, Trace) else read_trace(replay)


def engine_prefetcher(prefetch, options, history, spec, replay_trace):
    """The prefetcher named ``prefetch`` (None: none) for a model of ``spec``, fitted on the ``history`` trace;
    one that reads the future only when the engine replays ``replay_trace``."""
    if prefetch is None:
        return None
    cls = prefetcher_info(prefetch)
    if cls.reads_future and replay_trace is None:
        raise ConfigError(f"prefetcher {prefetch!r} reads the future routing, which a running engine knows only "
                          "when it replays a trace (replay=TRACE); otherwise use `moe-offload simulate --timed`")
    prefetcher = make_prefetcher(prefetch, spec, options)
    if history is not None:
        from moe_offload.trace.format import Trace, read_trace

        trace = history if isinstance(history, Trace) else read_trace(history)
        meta = trace.meta
        if (meta.num_layers, meta.num_experts, meta.top_k) != (spec.num_layers, spec.num_experts, spec.top_k):
            raise ConfigError(f"{trace.path}: a trace of {meta.num_layers} layers x {meta.num_experts} experts, "
                              f"top-{meta.top_k} cannot teach a prefetcher for this model "
                              f"({spec.num_layers} x {spec.num_experts}, top-{spec.top_k})")
        prefetcher.fit(trace)
    elif cls.needs_history:
        raise ConfigError(f"prefetcher {prefetch!r} predicts from past sequences: give it a history trace "
                          "of this model (prefetch_history=..., --prefetch-history TRACE)")
    return prefetcher
