"""The options of a component (a policy, a prefetcher) as ``NAME.OPTION=VALUE`` on the command line or a dict
from Python: parsed, and refused where the component's constructor does not take them (moe_offload.values:
the same words from every entry point)."""

from __future__ import annotations

import inspect
import json
from typing import Callable, Iterable

from moe_offload.errors import ConfigError
from moe_offload.values import refuse

def component_options(items: Iterable[str], flag: str, form: str, kind: str, lookup: Callable,
                      skip: tuple[str, ...] = (), also: Callable | None = None) -> dict[str, dict]:
    """``NAME.OPTION=VALUE`` items of ``flag`` (``--policy-option``, ``--prefetch-option``; ``form`` spells
    its metavar) as {name: {option: value}}. ``lookup(name)`` returns the class of the ``kind`` (``policy``,
    ``prefetcher``) of that name and refuses an unknown name; an option its constructor does not take is
    refused here, naming those it takes
    (``skip``: constructor parameters that are not options, such as a policy's seed; ``also(name)``: options
    the component takes beside its constructor's, as {option: default}). Values are JSON
    where they parse (``0.5``, ``true``, ``[1, 2]``), else strings (a path); their types and ranges are
    checked by the component's constructor, with the same words as from Python."""
    options: dict[str, dict] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        component, dot, name = key.partition(".")
        if not sep or not dot or not name or not component:
            refuse(flag, item, f"is not {form}")
        cls = lookup(component)
        name = name.replace("-", "_")
        check_option_names(kind, component, cls, {name: None}, skip, also(component) if also else None)
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):
            value = raw  # a plain string such as a path
        options.setdefault(component, {})[name] = value
    return options


def option_defaults(cls, skip: tuple[str, ...] = ()) -> dict[str, object]:
    """The options a component's constructor takes (after ``self`` and ``spec``) and their defaults."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]
    return {p.name: p.default for p in parameters
            if p.name not in skip and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def check_option_names(kind: str, name: str, cls, options: dict | None, skip: tuple[str, ...] = (),
                       also: dict | None = None) -> None:
    """Refuse options that the ``kind`` (policy, prefetcher) ``name`` of class ``cls`` does not take, naming
    those it does (its constructor's, and ``also``: {option: default} it takes beside them)."""
    known = option_defaults(cls, skip) | (also or {})
    unknown = sorted(set(options or {}) - set(known))
    if unknown:
        takes = ", ".join(option if default is inspect.Parameter.empty else f"{option}={default!r}"
                          for option, default in known.items()) or "no options"
        raise ConfigError(f"{kind} {name!r} has no option {', '.join(unknown)}; it takes {takes}")
    missing = [option for option in required_options(cls, skip) if option not in (options or {})]
    if missing:
        raise ConfigError(f"{kind} {name!r} needs the option {', '.join(missing)} (it has no default)")


def required_options(cls, skip: tuple[str, ...] = ()) -> list[str]:
    """The options a component's constructor takes without a default: it cannot run unless given them."""
    return [option for option, default in option_defaults(cls, skip).items() if default is inspect.Parameter.empty]


def check_options_used(options: dict[str, dict], used: Iterable[str], flag: str, chosen_flag: str) -> None:
    """Refuse options given for a component the command does not run: they would change nothing."""
    used = set(used)
    for name, given in options.items():
        if name not in used:
            option = next(iter(given))
            raise ConfigError(f"{flag} {name}.{option}=...: {name} is not run here ({chosen_flag} "
                              f"{','.join(sorted(used)) or 'none'}); add it or drop the option")
