"""What every engine model shares: a setting (the flags a user passes to the engine, and the placement they
make, expressed with this project's own mechanisms), what a model is asked with, and how a setting is scored.

A setting is run by the one timed simulator (simulator/timed) with the one expert cache: its placement is a
policy of the registry (static-layers, static-experts, lfru-dist, lru-dist) with its options, its misses are
loaded or computed on the host by the cache's admission (simulator/cache.py; ``uploads``: llama.cpp PR
#27861's uploads between passes, simulator/timed/uploads.py; ``layerwise``: whole layers streamed over the
link, KTransformers' layerwise prefill and dynamic expert update or vLLM's layer offloader,
simulator/timed/layerwise.py); ``split``: vLLM's offloaded tensors as split experts
(simulator/split.py). A setting the hardware cannot host (``cannot_host``: a mechanism that reads the experts
from host memory, where they do not fit) is listed with the reason and not scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from moe_offload.hardware.profile import HardwareProfile
from moe_offload.policies.base import ModelSpec
from moe_offload.simulator.split import SplitConfig
from moe_offload.simulator.timed import simulate_timed
from moe_offload.simulator.timed.layerwise import StreamedLayers
from moe_offload.simulator.timed.uploads import UploadsBetweenPasses
from moe_offload.simulator.transfers import home_tier
from moe_offload.trace.format import Trace
from moe_offload.values import format_bytes


@dataclass(frozen=True)
class PlacementContext:
    """What an engine model enumerates its settings from: the model's shape, the room in fast memory (whole
    experts), the traffic a placement may be chosen from (never the traffic it is scored on), the hardware
    and the size of an expert (None: unknown, and nothing timed)."""

    spec: ModelSpec
    slots: int
    profile: Trace
    hardware: HardwareProfile
    expert_bytes: int | None
    seed: int = 0
    timed_tokens: int = 1024

    @property
    def total(self) -> int:
        return self.spec.num_layers * self.spec.num_experts

    def outside_host_memory(self, mechanism: str) -> str | None:
        """Why a setting whose ``mechanism`` needs the experts in host memory (the tier after the GPU) cannot be
        timed on this hardware, or None where they fit there (or their size is unknown: nothing is timed)."""
        if not self.expert_bytes:
            return None
        every = self.total * self.expert_bytes
        if home_tier(self.hardware, every) == 1:
            return None
        host = self.hardware.tiers[1]
        return (f"not timed: {mechanism}, and the {self.total:,} experts ({format_bytes(every)}) do not fit "
                f"{self.hardware.name}'s {host.name} tier ({format_bytes(host.capacity_bytes)})")


@dataclass
class Setting:
    """One way to run the engine at the budget. ``flags`` are the engine's own arguments, exactly as typed;
    ``resident`` the experts it keeps in fast memory from the start (flat ids layer * J + expert); ``policy``
    and ``options`` how the timed simulator runs it;
    ``from_traffic``: its placement is chosen from the profile; ``export`` writes the file the engine reads
    (path -> None), when it reads one."""

    engine: str
    label: str
    flags: list[str]
    policy: str
    options: dict = field(default_factory=dict)
    resident: list[int] = field(default_factory=list)
    from_traffic: bool = False
    kind: str = ""  # which rule chose it (``frequency``, ``ot``): the same rule on other traffic is its twin
    note: str = ""
    export: Callable[[str], None] | None = None
    export_name: str | None = None  # the file name ``flags`` refer to
    split: SplitConfig | None = None  # split experts (vLLM's offloaded tensors: engines/vllm.py), or None
    uploads: int | None = None  # uploads per layer per pass between passes (PR #27861's admission), or None
    cache_slots: int | None = None  # the experts its cache holds, where less than the budget (None: the budget)
    layerwise: dict | None = None  # StreamedLayers' keywords (streamed whole layers: layerwise.py), or None
    cannot_host: str | None = None  # why the hardware cannot run it (then it is listed, not scored), or None

    def run_key(self) -> tuple:
        """What its timed run depends on: settings of equal keys (SGLang's kt backend is KTransformers) run once."""
        return (self.policy, repr(sorted(self.options.items())), self.uploads, self.cache_slots,
                repr(sorted((self.layerwise or {}).items())),
                self.split)


@dataclass
class EngineModel:
    """An engine: its name, the command its flags go to, where its semantics come from, and its settings at a
    budget (``settings(context)``); ``limits`` says what it cannot express; ``reads_files``: some of its
    settings read a file `placement -o` writes (``Setting.export``)."""

    name: str
    command: str
    source: str
    settings: Callable[[PlacementContext], list[Setting]]
    limits: str = ""
    reads_files: bool = False


def run_setting(setting: Setting, trace: Trace, context: PlacementContext, name: str | None = None):
    """The timed simulator's run (a RunResult) of ``setting`` on ``trace`` (the scored part's sample) at the
    context's budget."""
    slots = context.slots if setting.cache_slots is None else setting.cache_slots
    uploads = UploadsBetweenPasses(setting.uploads) if setting.uploads is not None else None
    layerwise = StreamedLayers(**setting.layerwise) if setting.layerwise is not None else None
    return simulate_timed(trace, context.hardware, setting.policy, slots * context.expert_bytes,
                          expert_bytes=context.expert_bytes, policy_options=setting.options, seed=context.seed,
                          name=name, uploads=uploads, layerwise=layerwise, split=setting.split)


def layer_keys(layers, num_experts: int) -> list[int]:
    """Every expert of ``layers``, as flat ids."""
    return [layer * num_experts + expert for layer in sorted(layers) for expert in range(num_experts)]
