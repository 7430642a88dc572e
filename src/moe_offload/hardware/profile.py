"""Hardware profiles: the memory tiers experts live in, the links between them, and what computing costs.

A profile is a small TOML file (the presets are in ``presets/``, one per machine, each citing its spec
sheets)::

    name = "desktop-rtx4090"
    description = "..."
    sources = ["spec sheet ...", "..."]

    [[tiers]]                  # fastest first: the first tier is where experts must be to compute
    name = "gpu"
    capacity_bytes = "24 GiB"  # an integer, or a string with a unit (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)

    [[links]]                  # one per tier after the first, from it to the next faster tier
    from = "host"
    to = "gpu"
    bandwidth_bytes_per_s = 25e9   # `inf` is allowed: transfers then cost only their latency
    latency_s = 10e-6              # per transfer, paid before the bytes flow
    slowdown_while_computing = 1.0 # optional: transfers take this many times longer while compute runs

    [compute]                  # times of one iteration's work, as functions of its tokens n
    attention = { fixed_s = 5.3e-5, per_token_s = 2.0e-7 }   # one layer: fixed_s + per_token_s * n
    router = { fixed_s = 1.0e-5, per_token_s = 0.0 }         # one layer
    lm_head = { fixed_s = 2.1e-4, per_token_s = 1.3e-6 }     # once per iteration
    # one expert on the n tokens routed to it: either linear like the others,
    #   expert = { fixed_s = ..., per_token_s = ... }
    # or the GPU's roofline, from the expert's bytes (P = expert_bytes / bytes_per_param parameters):
    #   expert_overhead_s + max(expert_bytes / memory_bandwidth_bytes_per_s, 2 * P * n / flops_per_s)
    flops_per_s = 165.2e12
    memory_bandwidth_bytes_per_s = 1008e9
    expert_overhead_s = 5e-6
    bytes_per_param = 2
    slowdown_while_loading = 1.0   # optional: compute takes this many times longer while a transfer runs

    [host]                     # optional: the CPU that computes the experts a placement leaves in host memory
    # the same two forms as the GPU's experts: a roofline from the CPU's memory bandwidth and FLOPs,
    flops_per_s = 2.5e12
    memory_bandwidth_bytes_per_s = 83e9
    expert_overhead_s = 20e-6
    bytes_per_param = 2            # optional: the GPU's by default
    # or a measured cost, expert = { fixed_s = ..., per_token_s = ... }
    on_compute_device = false      # optional: true when the host is the processor that computes the fast
                                   # tier's experts (no GPU): its experts then run after those, no link crossed

    [decision_s]               # optional: one eviction decision of a policy, measured, in seconds
    learned = 158e-6           # paper 003 section 3.1; a policy not named here costs what its FLOPs rule gives
                               # (simulator/timed/decisions.py), 0 for the bookkeeping policies

A bypassed expert (simulator/cache.py: Admission) costs ``host.expert_seconds(tokens)``; without ``[host]``
no policy or rule may bypass a miss. ``hardware measure`` measures the host's expert on the CPU.

The two slowdowns describe a machine whose compute and transfers share something: on a CPU the data path reads
and converts experts on the cores that compute, and its Python holds the interpreter's lock the decode needs.
``hardware measure`` measures both by decoding with experts streaming in the background; a GPU's copy engine
shares little, and the presets, made from spec sheets, leave both at 1.

Why only a chain of links: the tiers of an offloading server form one pipeline (SSD -> host -> GPU in
MoE-Infinity, paper 002 section 5), with one copy engine or I/O thread per hop; a transfer between
non-adjacent tiers goes through the tiers between them.

Every problem with a profile file (missing, not TOML, a missing key, a bad value) is a ConfigError that
names the file and the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from moe_offload.errors import ConfigError
from moe_offload.hardware.choices import COMPUTE_DTYPES, EXPERT_DTYPES, EXPERT_FORMS, QUANTIZED
from moe_offload.inputs import missing, parse_toml, read_text
from moe_offload.policies import POLICIES
from moe_offload.values import number, parse_bytes

PRESET_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "desktop-rtx4090"
# The ranges a profile's numbers must lie in. An operation of more than an hour, a rate below one per
# second or bytes per parameter outside [1/64, 64] is a unit mistake, and keeps the simulator's clock
# finite (a latency of 1e308 s would overflow it).
MAX_SECONDS = 3600.0
MIN_RATE = 1.0
BYTES_PER_PARAM = (1 / 64, 64.0)
MAX_SLOWDOWN = 100.0  # compute or a link 100 times slower while the other runs: no machine shares that badly

@dataclass(frozen=True)
class Tier:
    name: str
    capacity_bytes: int


@dataclass(frozen=True)
class Link:
    """A one-way link from ``source`` to ``destination`` (the next faster tier). One transfer at a time
    uses it: paper 002 section 5.3 copies one expert at a time per link to avoid bandwidth contention."""

    source: str
    destination: str
    bandwidth_bytes_per_s: float
    latency_s: float
    slowdown_while_computing: float = 1.0  # transfers take this many times longer while compute runs

    @property
    def name(self) -> str:
        return f"{self.source}->{self.destination}"

    def transfer_seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class LinearCost:
    """fixed_s + per_token_s * tokens."""

    fixed_s: float
    per_token_s: float

    def __call__(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens


@dataclass(frozen=True)
class Roofline:
    """An expert's time on the GPU: it reads its weights once and does 2 FLOPs per parameter and token."""

    flops_per_s: float
    memory_bandwidth_bytes_per_s: float
    expert_overhead_s: float
    bytes_per_param: float

    def expert_seconds(self, tokens: int, expert_bytes: int) -> float:
        flops = 2.0 * expert_bytes / self.bytes_per_param * tokens
        return self.expert_overhead_s + max(expert_bytes / self.memory_bandwidth_bytes_per_s,
                                            flops / self.flops_per_s)


@dataclass(frozen=True)
class ComputeModel:
    attention: LinearCost   # one layer
    router: LinearCost      # one layer
    lm_head: LinearCost     # once per iteration
    expert: LinearCost | None = None     # one expert, when given explicitly ...
    roofline: Roofline | None = None     # ... otherwise from the roofline
    slowdown_while_loading: float = 1.0  # compute runs this many times slower while a transfer is on a wire

    def expert_seconds(self, tokens: int, expert_bytes: int) -> float:
        if self.expert is not None:
            return self.expert(tokens)
        return self.roofline.expert_seconds(tokens, expert_bytes)


@dataclass(frozen=True)
class HostCompute:
    """The host CPU's time for one expert on the tokens routed to it, from the expert's copy in host memory:
    a measured linear cost, or the CPU's roofline. ``on_compute_device``: the host is the processor that
    computes the fast tier's experts too (a machine without a GPU), so its experts run after those, on the
    same compute stream, and no hidden states cross a link."""

    expert: LinearCost | None = None
    roofline: Roofline | None = None
    on_compute_device: bool = False

    def expert_seconds(self, tokens: int, expert_bytes: int) -> float:
        if self.expert is not None:
            return self.expert(tokens)
        return self.roofline.expert_seconds(tokens, expert_bytes)


@dataclass(frozen=True)
class RuntimeChoices:
    """What ``hardware measure`` found fastest for the runtime on this machine (runtime/measure/forms.py), per
    expert dtype of a pack: the fast tier's compute dtype, and for int8/int4 experts the form the fast tier holds
    them in (runtime/expert_forms.py). ``generate`` and ``serve`` given the profile use them where ``--dtype`` /
    ``--expert-compute`` are not given."""

    device: str  # "cpu" or "cuda": the device they were measured on, the only one they apply to
    dtype: dict[str, str]
    expert_compute: dict[str, str]


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    sources: tuple[str, ...]
    tiers: tuple[Tier, ...]   # fastest first
    links: tuple[Link, ...]   # links[i - 1] carries tier i to tier i - 1
    compute: ComputeModel
    path: str = "<memory>"
    host: HostCompute | None = None  # the CPU computing bypassed experts; None: nothing can be bypassed
    decision_s: tuple[tuple[str, float], ...] = ()  # (policy, seconds per eviction decision), measured
    runtime: RuntimeChoices | None = None  # a measured profile's choices for the runtime; None: its defaults

    def link_from(self, tier_index: int) -> Link:
        """The link that carries experts out of tier ``tier_index`` (>= 1) into the next faster tier."""
        return self.links[tier_index - 1]

    @classmethod
    def from_dict(cls, data: dict, path: str = "<memory>", default_name: str = "custom") -> "HardwareProfile":
        return _Reader(data, path).profile(default_name)


def load_profile(path) -> HardwareProfile:
    """Read a profile file; a ConfigError names the file and the key when it is missing or wrong."""
    path = Path(path)
    if missing(path):
        raise ConfigError(f"{path}: no such hardware profile file (presets: {', '.join(preset_names())})")
    data = parse_toml(read_text(path, "hardware profile"), path, "hardware profile")
    return HardwareProfile.from_dict(data, str(path), default_name=path.stem)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def resolve_profile(name_or_path: str | None) -> HardwareProfile:
    """A preset by name, or a profile file by path; the default preset when None."""
    name_or_path = name_or_path or DEFAULT_PRESET
    preset = PRESET_DIR / f"{name_or_path}.toml"
    if preset.is_file():
        return load_profile(preset)
    if missing(name_or_path) and "/" not in name_or_path and not name_or_path.endswith(".toml"):
        raise ConfigError(f"unknown hardware preset {name_or_path!r}; choose from {', '.join(preset_names())} "
                          "or give a profile file (`moe-offload hardware list`)")
    return load_profile(name_or_path)


class _Reader:
    """Typed access to the TOML tables, naming the file and the key in every error."""

    def __init__(self, data: dict, path: str):
        self.data, self.path = data, path

    def fail(self, key: str, problem: str):
        raise ConfigError(f"{self.path}: key {key!r}: {problem}")

    def table(self, parent: dict, key: str, where: str) -> dict:
        value = parent.get(key)
        if not isinstance(value, dict):
            self.fail(where, "missing table" if value is None else f"must be a table, not {value!r}")
        return value

    def number(self, parent: dict, key: str, where: str, *, low: float, high: float | None = None,
               allow_inf=False, default=None) -> float:
        value = parent.get(key, default)
        if value is None:
            self.fail(where, "missing")
        if allow_inf and isinstance(value, float) and value == math.inf:
            return value
        return number(value, f"{self.path}: key {where!r}", low=low, high=high)

    def seconds(self, parent: dict, key: str, where: str, default=None) -> float:
        return self.number(parent, key, where, low=0, high=MAX_SECONDS, default=default)

    def rate(self, parent: dict, key: str, where: str) -> float:
        """Bytes or FLOPs per second: at least MIN_RATE, or ``inf`` (free)."""
        return self.number(parent, key, where, low=MIN_RATE, allow_inf=True)

    def text(self, parent: dict, key: str, where: str, default=None) -> str:
        value = parent.get(key, default)
        if not isinstance(value, str) or not value:
            self.fail(where, "missing" if value is None else f"must be a non-empty string, not {value!r}")
        return value

    def linear(self, compute: dict, key: str, table: str = "compute") -> LinearCost:
        where = f"{table}.{key}"
        table = self.table(compute, key, where)
        unknown = set(table) - {"fixed_s", "per_token_s"}
        if unknown:
            self.fail(f"{where}.{sorted(unknown)[0]}", "unknown key (a cost has fixed_s and per_token_s)")
        return LinearCost(self.seconds(table, "fixed_s", f"{where}.fixed_s"),
                          self.seconds(table, "per_token_s", f"{where}.per_token_s", default=0.0))

    def profile(self, default_name: str) -> HardwareProfile:
        data = self.data
        name = self.text(data, "name", "name", default=default_name)
        description = data.get("description", "")
        sources = data.get("sources", [])
        if not isinstance(description, str):
            self.fail("description", f"must be a string, not {description!r}")
        if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
            self.fail("sources", "must be a list of strings")

        raw_tiers = data.get("tiers")
        if not isinstance(raw_tiers, list) or not raw_tiers or not all(isinstance(t, dict) for t in raw_tiers):
            self.fail("tiers", "missing: give at least one [[tiers]] table (fastest first)")
        tiers = []
        for i, raw in enumerate(raw_tiers):
            tier_name = self.text(raw, "name", f"tiers[{i}].name")
            if any(t.name == tier_name for t in tiers):
                self.fail(f"tiers[{i}].name", f"tier {tier_name!r} is listed twice")
            capacity = raw.get("capacity_bytes")
            if capacity is None:
                self.fail(f"tiers[{i}].capacity_bytes", "missing")
            tiers.append(Tier(tier_name, parse_bytes(capacity, f"{self.path}: key 'tiers[{i}].capacity_bytes'")))

        raw_links = data.get("links", [])
        if not isinstance(raw_links, list) or not all(isinstance(k, dict) for k in raw_links):
            self.fail("links", "must be a list of [[links]] tables")
        by_pair = {}
        names = [t.name for t in tiers]
        for i, raw in enumerate(raw_links):
            source = self.text(raw, "from", f"links[{i}].from")
            destination = self.text(raw, "to", f"links[{i}].to")
            for key, tier_name in (("from", source), ("to", destination)):
                if tier_name not in names:
                    self.fail(f"links[{i}].{key}", f"no tier named {tier_name!r} (tiers: {', '.join(names)})")
            if names.index(source) != names.index(destination) + 1:
                self.fail(f"links[{i}]", f"{source} -> {destination}: a link must go from a tier to the next "
                                         "faster one (the tiers are listed fastest first)")
            if source in by_pair:
                self.fail(f"links[{i}]", f"a second link from {source}")
            by_pair[source] = Link(source, destination,
                                   self.rate(raw, "bandwidth_bytes_per_s", f"links[{i}].bandwidth_bytes_per_s"),
                                   self.seconds(raw, "latency_s", f"links[{i}].latency_s", default=0.0),
                                   self.number(raw, "slowdown_while_computing",
                                               f"links[{i}].slowdown_while_computing", low=1.0, high=MAX_SLOWDOWN,
                                               default=1.0))
        for tier in tiers[1:]:
            if tier.name not in by_pair:
                self.fail("links", f"no link from tier {tier.name!r} to the next faster tier")
        links = tuple(by_pair[t.name] for t in tiers[1:])

        compute = self.table(data, "compute", "compute")
        expert, roofline = self.expert_cost(compute, "compute", 2.0)
        host = None
        if "host" in data:
            table = self.table(data, "host", "host")
            unknown = set(table) - {"expert", "flops_per_s", "memory_bandwidth_bytes_per_s", "expert_overhead_s",
                                    "bytes_per_param", "on_compute_device"}
            if unknown:
                self.fail(f"host.{sorted(unknown)[0]}", "unknown key (the host has expert or the roofline keys, and "
                                                        "on_compute_device)")
            default_bytes = roofline.bytes_per_param if roofline is not None else 2.0
            shared = table.get("on_compute_device", False)
            if not isinstance(shared, bool):
                self.fail("host.on_compute_device", f"must be true or false, not {shared!r}")
            host = HostCompute(*self.expert_cost(table, "host", default_bytes), on_compute_device=shared)
        model = ComputeModel(attention=self.linear(compute, "attention"), router=self.linear(compute, "router"),
                             lm_head=self.linear(compute, "lm_head"), expert=expert, roofline=roofline,
                             slowdown_while_loading=self.number(compute, "slowdown_while_loading",
                                                                "compute.slowdown_while_loading", low=1.0,
                                                                high=MAX_SLOWDOWN, default=1.0))
        runtime = self.runtime_choices(self.table(data, "runtime", "runtime")) if "runtime" in data else None
        return HardwareProfile(name=name, description=description, sources=tuple(sources), tiers=tuple(tiers),
                               links=links, compute=model, path=self.path, host=host,
                               decision_s=self.decision_seconds(data), runtime=runtime)

    def decision_seconds(self, data: dict) -> tuple[tuple[str, float], ...]:
        """The optional ``[decision_s]`` table: policy name -> seconds of one eviction decision."""
        table = self.table(data, "decision_s", "decision_s") if "decision_s" in data else {}
        for policy in table:
            if policy not in POLICIES:
                self.fail(f"decision_s.{policy}", f"no policy of that name; choose from {', '.join(POLICIES)}")
        return tuple((policy, self.seconds(table, policy, f"decision_s.{policy}")) for policy in sorted(table))

    def runtime_choices(self, table: dict) -> RuntimeChoices:
        """``[runtime]``: ``device``, ``dtype`` (expert dtype -> compute dtype) and ``expert_compute`` (int8/int4 ->
        form)."""
        unknown = set(table) - {"device", "dtype", "expert_compute"}
        if unknown:
            self.fail(f"runtime.{sorted(unknown)[0]}",
                      "unknown key (the runtime table has device, dtype and expert_compute)")
        device = self.text(table, "device", "runtime.device")
        if device not in ("cpu", "cuda"):
            self.fail("runtime.device", f"{device!r}: cpu or cuda")
        choices = {"device": device}
        for key, experts, allowed in (("dtype", EXPERT_DTYPES, COMPUTE_DTYPES),
                                      ("expert_compute", QUANTIZED, EXPERT_FORMS)):
            chosen = self.table(table, key, f"runtime.{key}") if key in table else {}
            for expert_dtype, value in chosen.items():
                if expert_dtype not in experts:
                    self.fail(f"runtime.{key}.{expert_dtype}", f"not an expert dtype ({', '.join(experts)})")
                if value not in allowed:
                    self.fail(f"runtime.{key}.{expert_dtype}", f"{value!r}: choose from {', '.join(allowed)}")
            choices[key] = dict(chosen)
        return RuntimeChoices(**choices)

    def expert_cost(self, table: dict, where: str, default_bytes_per_param: float):
        """(linear cost, None) from ``where.expert``, or (None, roofline) from ``where``'s roofline keys."""
        if "expert" in table:
            return self.linear(table, "expert", where), None
        if "flops_per_s" not in table and "memory_bandwidth_bytes_per_s" not in table:
            self.fail(f"{where}.expert", f"missing: give {where}.expert = {{ fixed_s, per_token_s }} or the "
                                         "roofline keys flops_per_s and memory_bandwidth_bytes_per_s")
        return None, Roofline(
            self.rate(table, "flops_per_s", f"{where}.flops_per_s"),
            self.rate(table, "memory_bandwidth_bytes_per_s", f"{where}.memory_bandwidth_bytes_per_s"),
            self.seconds(table, "expert_overhead_s", f"{where}.expert_overhead_s", default=0.0),
            self.number(table, "bytes_per_param", f"{where}.bytes_per_param", low=BYTES_PER_PARAM[0],
                        high=BYTES_PER_PARAM[1], default=default_bytes_per_param))
