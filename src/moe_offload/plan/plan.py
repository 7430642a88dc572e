"""A plan: everything that decides a run, made once from the user's options and handed whole to what runs it.

The runtime engine (``OffloadEngine(plan)``, runtime/engine.py), the timed simulator's prediction of the same
run (``simulate_plan``, simulator/timed/simulate.py) and the report's recommendation (reporting/recommend.py,
which writes a plan back as `generate`/`serve` options) read the same fields, so they cannot disagree about
what a configuration means; each reports it back in ``RunResult.configuration`` (``Plan.describe()``).

The fields, by what they decide:

- **Budgets.** ``fast_budget`` and ``host_budget`` as the user wrote them (a share of all experts, a size;
  values.budget_bytes reads them). They become bytes only against a model: the fast budget is of all experts
  in the dtype the fast tier holds them (``dtype``, or the expert form's bytes for quantized experts), the
  host budget of the experts as stored, each rounded down to whole experts (``fast_experts``).
- **Tiers.** ``hardware``: the profile (a preset's name or a file; None: the default preset) whose links and
  host compute the timed simulator runs, whose link sets the prefetcher's budget per layer in both, whose
  costs decide fetch-or-compute, and whose ``[runtime]`` table gives ``dtype``/``expert_compute`` where they
  are None. ``host_budget`` adds the runtime's host tier.
- **Placement** (``placement``, named from the policy): ``streamed`` experts are loaded on a miss into a
  fast tier the policy evicts from; ``host-layers`` keeps whole layers' experts on the host and computes them
  there (static-layers: llama.cpp's --n-cpu-moe, or ``-ot`` on whole layers; ``fast_layers`` the layers kept
  fast); ``static-experts`` keeps a fixed set of experts fast and computes the rest on the host
  (static-freq from a ``profile``, or static-experts from a given set: KTransformers' placement and llama.cpp's
  ``-ot`` by expert);
  ``pinned`` pins a profile's share and streams the rest (pinned-lru). ``fetch_or_compute`` adds Fiddler's
  admission rule to a streamed placement: a miss the host computes faster than it loads is not admitted.
- **Policy and prefetcher**, with their options; ``prefetch_history`` the trace a learning prefetcher fits
  (``history``: the bundled one for the bundled model).
- **Split.** MoEpic's split experts: ``split_config`` (a `configure --json` file or a SplitConfig) and its
  online loop (``reconfiguration``: every tau tokens, Algorithm 1's granularity).
- **Forms and dtypes.** ``expert_dtype`` (how the experts are packed), ``dtype`` (the fast tier's compute
  dtype), ``expert_compute`` (how the fast tier holds quantized experts).
- **Batching.** ``max_batch`` requests per forward pass, ``batch_math``, and where fMoE's ``matcher`` runs.
- **The run itself.** ``model``, ``device``, ``seed``, the slow tier's ``readers``, checksum and page-cache
  choices, ``preload``, and a ``replay`` trace whose routing every router is forced to.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from moe_offload import values
from moe_offload.bundled import TINY_HISTORY_TRACE
from moe_offload.errors import ConfigError
from moe_offload.hardware import HardwareProfile, resolve_profile
from moe_offload.prefetch import Prefetcher, prefetcher_info

PAPER_TAU = 5000  # MoEpic's tokens between two online configurations (paper 004)


@dataclass(frozen=True)
class Reconfiguration:
    """The options of MoEpic's online loop (simulator/timed/reconfigure.py, runtime/split_online.py): tau
    (tokens between two configurations) and Algorithm 1's zeta."""

    every: int = PAPER_TAU
    granularity: float = 0.01

    def check(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"the reconfiguration period tau must be a positive number of tokens, not {self.every!r}")
        if not 0 < self.granularity < 1:
            raise ConfigError(f"the allocation granularity zeta must be in (0, 1), not {self.granularity:g}")


# what a policy does with the fast tier (module doc); a policy not named here streams
PLACEMENTS = {"static-layers": "host-layers", "static-freq": "static-experts", "static-experts": "static-experts",
              "pinned-lru": "pinned"}


@dataclass(frozen=True)
class Plan:
    """Everything that decides a run (module doc). Make one with :func:`moe_offload.plan.make_plan`, which
    checks it; the fields are then final."""

    model: Any = "tiny"
    expert_dtype: str | None = None
    fast_budget: Any = "50%"
    host_budget: Any = None
    dtype: str | None = None
    expert_compute: str | None = None
    device: Any = None
    hardware: Any = None
    policy: str = "lru"
    policy_options: dict | None = None
    prefetch: str | None = None
    prefetch_options: dict | None = None
    prefetch_history: Any = None
    fetch_or_compute: bool = False
    split_config: Any = None
    reconfiguration: Reconfiguration | None = None
    max_batch: int = 16
    batch_math: str = "exact"
    matcher: str = "async"
    seed: int = 0
    readers: int | None = None
    verify_checksums: bool = True
    bypass_page_cache: bool = False
    retries: int = 3
    preload: bool = False
    replay: Any = None
    replay_weights: str = "trace"
    notes: tuple[str, ...] = field(default=(), compare=False)

    # ------------------------------------------------------------------------------------------ placement
    @property
    def placement(self) -> str:
        """``streamed``, ``host-layers``, ``static-experts`` or ``pinned`` (module doc)."""
        return PLACEMENTS.get(self.policy, "streamed")

    @property
    def admission(self) -> str | None:
        """The fast tier's admission rule: ``fetch-or-compute`` (Fiddler's), or None (every miss is loaded)."""
        return "fetch-or-compute" if self.fetch_or_compute else None

    @property
    def split(self) -> bool:
        """Whether the fast tier is MoEpic's split experts (a configuration, or its online loop alone)."""
        return self.split_config is not None or self.reconfiguration is not None

    def profile(self) -> HardwareProfile:
        """The hardware profile: ``hardware`` itself, the preset it names or the file it is; the default preset
        for None."""
        return self.hardware if isinstance(self.hardware, HardwareProfile) else resolve_profile(self.hardware)

    @property
    def history(self):
        """The trace the prefetcher fits: ``prefetch_history``, else, for the bundled ``tiny`` model and a prefetcher
        that learns (MoE-Infinity, fMoE), the bundled recording of the same model on other prompts; or None."""
        if self.prefetch is None or self.prefetch_history is not None:
            return self.prefetch_history
        learns = prefetcher_info(self.prefetch).fit is not Prefetcher.fit
        return TINY_HISTORY_TRACE if learns and str(self.model) == "tiny" else None

    # ------------------------------------------------------------------------------------------- budgets
    def fast_budget_bytes(self, total_bytes: int, expert_bytes: int, experts: int) -> int:
        """The fast budget in bytes: a bare number is that many of the ``experts`` experts of ``expert_bytes``
        each as the fast tier holds them, a share is of ``total_bytes`` (all experts in the compute dtype, so a
        share is the same memory for every pack of a model), bytes need a unit. The budgets are read here and
        nowhere else (values.budget_bytes)."""
        return values.budget_bytes(self.fast_budget, total_bytes, "--fast-budget", expert_bytes=expert_bytes,
                                   experts=experts)

    def fast_experts(self, expert_bytes: int, experts: int) -> int:
        """The whole experts of ``expert_bytes`` the fast budget holds, at most all ``experts``."""
        return min(self.fast_budget_bytes(experts * expert_bytes, expert_bytes, experts) // expert_bytes, experts)

    def host_experts(self, expert_bytes: int, experts: int) -> int:
        """The whole experts (as stored, ``expert_bytes`` each) the host budget holds; 0 without a host tier."""
        if self.host_budget is None:
            return 0
        budget = values.budget_bytes(self.host_budget, experts * expert_bytes, "--host-budget",
                                     expert_bytes=expert_bytes, experts=experts)
        return min(budget // expert_bytes, experts)

    # ---------------------------------------------------------------------------------------- reporting
    def describe(self) -> dict:
        """The choices that decide what a run computes and moves, as JSON values: what a RunResult reports back
        as its ``configuration``, the same for the runtime and the timed simulator (paths as strings)."""
        return {"fast_budget": _text(self.fast_budget), "host_budget": _text(self.host_budget),
                "placement": self.placement, "admission": self.admission, "policy": self.policy,
                "policy_options": _plain(self.policy_options), "prefetch": self.prefetch,
                "prefetch_options": _plain(self.prefetch_options),
                "split_config": _text(self.split_config) if self.split_config is None or
                isinstance(self.split_config, str) or hasattr(self.split_config, "__fspath__")
                else asdict(self.split_config),
                "reconfiguration": None if self.reconfiguration is None else asdict(self.reconfiguration),
                "hardware": _text(getattr(self.hardware, "name", self.hardware)),
                "expert_dtype": self.expert_dtype, "dtype": self.dtype, "expert_compute": self.expert_compute,
                "max_batch": self.max_batch, "batch_math": self.batch_math}

    def options(self) -> list[str]:
        """The plan as the options of `moe-offload generate` (``serve`` takes the same but ``--split-config``,
        ``--reconfigure-every`` and ``--granularity``), defaults left out; ``--model`` first."""
        words = ["--model", _text(self.model)]
        online = self.reconfiguration
        flags = (("--expert-dtype", self.expert_dtype), ("--dtype", self.dtype),
                 ("--expert-compute", self.expert_compute), ("--fast-budget", self.fast_budget),
                 ("--host-budget", self.host_budget), ("--hardware", getattr(self.hardware, "name", self.hardware)),
                 ("--policy", self.policy), ("--prefetch", self.prefetch),
                 ("--prefetch-history", self.prefetch_history), ("--split-config", self.split_config),
                 ("--reconfigure-every", online and online.every), ("--granularity", online and online.granularity),
                 ("--device", self.device))
        for flag, value in flags:
            if value is not None:
                words += [flag, str(value)]
        for flag, name, options in (("--policy-option", self.policy, self.policy_options),
                                    ("--prefetch-option", self.prefetch, self.prefetch_options)):
            for option, value in (options or {}).items():
                words += [flag, f"{name}.{option}={value}"]
        if self.fetch_or_compute:
            words.append("--fetch-or-compute")
        return words


def _text(value) -> str | None:
    return None if value is None else str(value)


def _plain(options: dict | None) -> dict | None:
    """Options as JSON values (a path as its string)."""
    if not options:
        return None
    return {name: value if isinstance(value, (bool, int, float, str, list, type(None))) else str(value)
            for name, value in options.items()}
