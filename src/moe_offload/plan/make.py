"""``make_plan``: the user's options (the CLI's, through cli/options.py; the Python API's keywords, through
``moe_offload.load``) turned into a Plan and checked once, before any model is read.

What is checked here is what the options say of each other and of the registries: names (policy, prefetcher,
dtypes, forms, batch arithmetic, matcher), the components' option names, the hardware profile (read once), a
placing policy's needs (a profile or a replayed trace to choose from, no prefetcher for a static placement, no
split) and its host tier (every expert by default), and Fiddler's rule's (a dynamic policy, an unsplit run, a
profile with a host tier and the host's time per expert). A bad option is refused with a one-line ConfigError
naming it. What needs the model (whether a budget holds top-k experts, whether a split fits) is checked where
the model is read: the engine's set-up and the timed simulator's ``check_timed_run``.
"""

from __future__ import annotations

from moe_offload import values
from moe_offload.errors import ConfigError
from moe_offload.hardware import HardwareProfile, resolve_profile
from moe_offload.hardware.choices import COMPUTE_DTYPES, EXPERT_COMPUTE, EXPERT_DTYPES
from moe_offload.plan.choices import BATCH_MATH, MATCHERS, REPLAY_WEIGHTS
from moe_offload.plan.plan import Plan, Reconfiguration
from moe_offload.policies import policy_info
from moe_offload.prefetch import prefetcher_info
from moe_offload.values.options import check_option_names, option_defaults

def make_plan(model="tiny", *, fast_budget="50%", host_budget=None, policy: str = "lru",
              policy_options: dict | None = None, prefetch: str | None = None, prefetch_options: dict | None = None,
              prefetch_history=None, expert_dtype: str | None = None, dtype: str | None = None,
              expert_compute: str | None = None, device=None, hardware=None, fetch_or_compute: bool = False,
              split_config=None, reconfiguration=None, reconfigure_every: int | None = None,
              granularity: float | None = None, max_batch: int = 16, batch_math: str = "exact",
              matcher: str = "async", seed: int = 0, readers: int | None = None, verify_checksums: bool = True,
              bypass_page_cache: bool = False, retries: int = 3, preload: bool = False, replay=None,
              replay_weights: str = "trace") -> Plan:
    """The checked Plan of these options (plan.py says what each decides). ``prefetch`` ``"none"`` is None;
    ``reconfigure_every`` and ``granularity`` (the CLI's) are another way to give ``reconfiguration``;
    ``hardware`` is a preset's name, a profile file or a HardwareProfile."""
    _choice(dtype, COMPUTE_DTYPES, "--dtype")
    _choice(expert_compute, EXPERT_COMPUTE, "--expert-compute")
    _choice(expert_dtype, EXPERT_DTYPES, "--expert-dtype")
    _choice(batch_math, BATCH_MATH, "batch_math")
    _choice(matcher, MATCHERS, "matcher")
    _choice(replay_weights, REPLAY_WEIGHTS, "replay weights")
    max_batch = values.integer(max_batch, "max_batch", low=1)
    seed = values.integer(seed, "seed", low=0)
    for value, flag in ((fast_budget, "--fast-budget"), (host_budget, "--host-budget")):
        if value is not None:  # its form now; its size against the model where the model is read
            values.budget_bytes(value, 1 << 40, flag, expert_bytes=1, experts=1 << 40)
    info = policy_info(policy)
    info.check_options(policy_options)
    if isinstance(prefetch, str) and prefetch.strip() == "none":
        prefetch = None
    if prefetch is not None:
        check_option_names("prefetcher", prefetch, prefetcher_info(prefetch), prefetch_options)
    elif prefetch_options:
        raise ConfigError("prefetch options without a prefetcher: add --prefetch NAME")
    if reconfigure_every is not None:
        reconfiguration = Reconfiguration(reconfigure_every, *(() if granularity is None else (granularity,)))
    elif granularity is not None:
        raise ConfigError("--granularity belongs to the online configuration: add --reconfigure-every")
    if reconfiguration is not None:
        reconfiguration.check()
    split = split_config is not None or reconfiguration is not None
    if split and preload:
        raise ConfigError(f"{split_config or 'the online configuration'}: the split runtime loads into the tops "
                          "and the buffer as experts are needed; it does not preload")
    profile = hardware if isinstance(hardware, HardwareProfile) else resolve_profile(hardware)  # refused now if bad
    if fetch_or_compute:
        check_fetch_or_compute(policy, profile, split)
    if info.policy.places_or_bypasses or fetch_or_compute:  # a refused miss computes from the host tier's copy
        host_budget = _placing_host_budget(info, policy_options, host_budget, replay is not None, split, prefetch)
    return Plan(model=model, expert_dtype=expert_dtype, fast_budget=fast_budget, host_budget=host_budget,
                dtype=dtype, expert_compute=expert_compute, device=device, hardware=hardware, policy=policy,
                policy_options=dict(policy_options) if policy_options else None, prefetch=prefetch,
                prefetch_options=dict(prefetch_options) if prefetch_options else None,
                prefetch_history=prefetch_history, fetch_or_compute=bool(fetch_or_compute),
                split_config=split_config, reconfiguration=reconfiguration,
                max_batch=max_batch, batch_math=batch_math, matcher=matcher, seed=seed, readers=readers,
                verify_checksums=verify_checksums, bypass_page_cache=bypass_page_cache, retries=retries,
                preload=preload, replay=replay, replay_weights=replay_weights)


def _choice(value, choices: tuple[str, ...], flag: str) -> None:
    if value is not None and value not in choices:
        raise ConfigError(f"{flag} {value!r}: choose from {', '.join(choices)}")


def check_fetch_or_compute(policy: str, profile: HardwareProfile, split: bool) -> None:
    """Fiddler's rule needs a dynamic policy, an unsplit run, and a profile with a host tier and the host's time
    per expert (policies/fetch_or_compute.py)."""
    if policy_info(policy).policy.static:
        raise ConfigError(f"--fetch-or-compute decides whether a miss is loaded; policy {policy!r} is a static "
                          "placement that loads none: drop one of them")
    if split:
        raise ConfigError("--fetch-or-compute computes whole experts on the host: it does not run with a split "
                          "configuration")
    if profile.host is None:
        raise ConfigError(f"hardware {profile.name} has no [host] compute: the fetch-or-compute rule needs the "
                          "host's time per expert (`moe-offload hardware measure` measures it)")
    if len(profile.tiers) < 2:
        raise ConfigError(f"hardware {profile.name} has no host tier for bypassed experts to live in")


def _placing_host_budget(info, policy_options: dict | None, host_budget, replaying: bool, split: bool,
                         prefetch: str | None):
    """The host budget of a run of the placing policy ``info`` (a PolicyInfo): the one given, else every expert
    (llama.cpp and KTransformers keep the experts they do not put on the GPU in system memory); the rest of the
    plan checked for what a placement needs."""
    name = info.name
    if split:
        raise ConfigError(f"policy {name!r} places experts itself: it does not run with a split configuration")
    if info.policy.static and prefetch is not None:
        raise ConfigError(f"policy {name!r} is a static placement: it loads nothing after the start, so there is "
                          f"nothing for the prefetcher {prefetch!r} to prefetch")
    if "profile" in option_defaults(info.policy) and not (policy_options or {}).get("profile") \
            and not replaying:
        raise ConfigError(f"policy {name!r} chooses its experts from a profile: give one (--profile TRACE, "
                          "profile=TRACE in Python), or replay a trace to choose from it in hindsight")
    return "100%" if host_budget is None else host_budget
