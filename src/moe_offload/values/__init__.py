"""One validation layer for the values a user gives, on the command line or through the Python API.

Every command and every public function that takes a size, a percentage, a count, a component option (in
values/options.py), a device or a limit checks it here, so a value is accepted or refused the same way wherever
it comes from, with the same words: ``WHAT VALUE: problem`` in one line, e.g. ``--cache-size '150%': a
percentage must be in (0, 100]`` or ``lcp.rho 'abc': must be a number in (0, 1)`` (the same text from
``--policy-option lcp.rho=abc`` and from ``replay(..., options={"rho": "abc"})``). Every problem is a
:class:`~moe_offload.errors.ConfigError`.

What is checked beyond the type: numbers are finite (``inf%``, ``NaN`` and ``1e400`` are refused rather than
turned into an OverflowError later), counts are whole and within their range, and limits that depend on
where the command runs or on the model are enforced here too (the processes ``--jobs`` starts against this
machine's cores and the work, a generation against the model's context, an allocation against this
machine's memory).
"""

from __future__ import annotations

import math
import numbers
import os
import re

from moe_offload.errors import ConfigError

# A byte count past this is no size of anything a machine holds (and would overflow int64 arithmetic).
MAX_BYTES = 2**62

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_BYTES_WITH_UNIT = re.compile(r"^\s*[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?\s*[kmgtKMGT]?i?[bB]\s*$")
_UNIT_NAMES = "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB"


def refuse(what: str, value, problem: str):
    """Raise the layer's one-line ConfigError: ``WHAT VALUE: problem``."""
    try:
        shown = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)
    except ValueError:  # an int of more digits than Python converts to text
        shown = "(a number too long to print)"
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise ConfigError(f"{what} {shown}: {problem}")


# ------------------------------------------------------------------------------------------------ numbers

def _interval(low, high, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'above' if low_open else 'at least'} {low:g}"
    if high is not None:
        return f"{'below' if high_open else 'at most'} {high:g}"
    return ""


def number(value, what: str, *, low: float | None = None, high: float | None = None, low_open: bool = False,
           high_open: bool = False) -> float:
    """A finite number (an int, a float or its text) within the given bounds."""
    expected = " ".join(filter(None, ("must be a number", _interval(low, high, low_open, high_open))))
    if isinstance(value, bool):
        refuse(what, value, expected)
    if isinstance(value, str):
        try:
            parsed = float(value.strip())
        except ValueError:
            refuse(what, value, expected)
    elif isinstance(value, numbers.Real):  # int, float and NumPy's scalars
        try:
            parsed = float(value)
        except OverflowError:
            parsed = math.inf
    else:
        refuse(what, value, expected)
    if not math.isfinite(parsed):
        refuse(what, value, f"{expected} (a finite one)")
    if (low is not None and (parsed < low or (low_open and parsed == low))) \
            or (high is not None and (parsed > high or (high_open and parsed == high))):
        refuse(what, value, expected)
    return parsed


def integer(value, what: str, *, low: int | None = None, high: int | None = None, why: str = "") -> int:
    """A whole number (an int, an integral float or the text of an int) in [low, high]; ``why`` explains
    the bound in the message (``the cores of this machine``)."""
    if low is not None and high is not None:
        expected = f"must be a whole number from {low:,} to {high:,}"
    elif low is not None:
        expected = f"must be a whole number of at least {low:,}"
    elif high is not None:
        expected = f"must be a whole number of at most {high:,}"
    else:
        expected = "must be a whole number"
    if why:
        expected += f" ({why})"
    if isinstance(value, bool):
        refuse(what, value, expected)
    if isinstance(value, str):
        try:
            parsed = int(value.strip())
        except ValueError:
            refuse(what, value, expected)
    elif isinstance(value, numbers.Integral):
        parsed = int(value)
    elif isinstance(value, numbers.Real):
        if not math.isfinite(value) or value != int(value):
            refuse(what, value, expected)
        parsed = int(value)
    else:
        refuse(what, value, expected)
    if (low is not None and parsed < low) or (high is not None and parsed > high):
        refuse(what, value, expected)
    return parsed


def integer_list(value, what: str, *, low: int | None = None, high: int | None = None) -> list[int]:
    """Whole numbers in [low, high]: a list or tuple of them, or their text separated by commas (``0,3,5``, as
    ``--policy-option NAME.KEY=0,3,5`` gives it); an empty text is the empty list."""
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    elif not isinstance(value, (list, tuple)):
        refuse(what, value, "must be a list of whole numbers (or their text separated by commas)")
    return [integer(item, what, low=low, high=high) for item in value]


def text(value, what: str) -> str:
    """A non-empty string (a name, a path)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        refuse(what, value, "must be a non-empty string")
    return value


# ------------------------------------------------------------------------------------- sizes and shares

def format_bytes(count: float) -> str:
    """Binary units for a whole number of them (capacities such as 24 GiB), decimal ones otherwise."""
    if float(count).is_integer():
        for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if size <= count < 1024 * size and count % size == 0:
                return f"{int(count) // size} {unit}"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count:.0f} B"


def format_seconds(seconds: float) -> str:
    """Three significant digits in the largest unit under the value (s, ms, us, ns): a decision of a few
    nanoseconds is not "0.0 us"."""
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def parse_bytes(value, what: str) -> int:
    """A byte count from an integer, a float or a string with a unit (``24 GiB``, ``12.5MB``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        refuse(what, value, f"is not a byte count (a number with an optional unit: {_UNIT_NAMES})")
    if isinstance(value, str):
        match = _BYTES.match(value)
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            refuse(what, value, f"is not a byte count (a number with an optional unit: {_UNIT_NAMES})")
        count = float(match.group(1)) * _UNITS[unit]
    else:
        try:
            count = float(value)
        except OverflowError:
            count = math.inf
    if not math.isfinite(count) or count < 1:
        refuse(what, value, "must be at least one byte" if not count >= 1 else "is too large for a byte count")
    if count > MAX_BYTES:
        refuse(what, value, "is too large for a byte count (more than 4 EiB)")
    return int(round(count))


def is_byte_size(text_value: str) -> bool:
    """Whether ``text_value`` is written as bytes with a unit (``4GiB``, ``512MB``, ``1200B``)."""
    return bool(_BYTES_WITH_UNIT.match(text_value))


def share(value, what: str) -> float:
    """A share of a whole in (0, 1]: a percentage (``25%``) or a fraction (``0.25``)."""
    if not isinstance(value, str):
        fraction, percent = number(value, what), False
    else:
        item = value.strip()
        percent = item.endswith("%")
        try:
            fraction = float(item[:-1] if percent else item)
        except ValueError:
            refuse(what, value, "is neither a percentage (25%) nor a fraction (0.25)")
    if percent:
        if not (math.isfinite(fraction) and 0 < fraction <= 100):
            refuse(what, value, "a percentage must be in (0, 100]")
        return fraction / 100
    if not (math.isfinite(fraction) and 0 < fraction <= 1):
        refuse(what, value, "a fraction must be in (0, 1]")
    return fraction


def _is_float(item: str) -> bool:
    try:
        float(item)
    except ValueError:
        return False
    return True


def expert_amount(value, what: str, total: int, expert_bytes: int | None = None, *,
                  allow_bytes: bool = True) -> float:
    """A number of experts out of ``total`` (all L*J of a model): a count (``240``), a percentage (``25%``)
    or a fraction (``0.25``) of all, or with ``allow_bytes`` bytes with a unit (``6GB``) of experts of
    ``expert_bytes`` each. The result may be fractional (a budget of 2.5 experts' bytes); it is above 0
    and at most ``total``."""
    item = value.strip() if isinstance(value, str) else str(value)
    if re.fullmatch(r"[+-]?[0-9]+", item):
        # compared as text past 30 digits: such a count is no model's, and Python refuses to parse 5,000 digits
        count = int(item) if len(item) <= 30 else (-1 if item.startswith("-") else total + 1)
        if count <= 0:
            refuse(what, value, "must be positive")
        if count > total:
            refuse(what, value, f"more than the model's {total:,} experts")
        experts = float(count)
    elif allow_bytes and is_byte_size(item):
        if not expert_bytes:
            refuse(what, value, "is in bytes, but the size of an expert is not known: give --expert-bytes")
        experts = parse_bytes(item, what) / expert_bytes
    elif item.endswith("%") or _is_float(item):
        experts = share(item, what) * total
    else:
        refuse(what, value, "is neither a number of experts, a percentage (25%), a fraction (0.25)"
                            + (" nor bytes with a unit (6GB)" if allow_bytes else ""))
    if experts > total * (1 + 1e-9):
        refuse(what, value, f"that is {experts:,.6g} experts, more than the model's {total:,}")
    return min(experts, float(total))


def cache_sizes(text_value: str, what: str, total: int, expert_bytes: int | None = None, *,
                in_bytes: bool = False) -> list[int]:
    """Comma-separated cache sizes, sorted and without repeats. Experts, percentages and fractions of all
    ``total`` experts are whole experts (``round``); with ``in_bytes`` each size is in bytes: a size written
    in bytes is kept as it is, the others are whole experts of ``expert_bytes``."""
    sizes = []
    for item in (part.strip() for part in str(text_value).split(",")):
        if not item:
            continue
        if in_bytes and is_byte_size(item):
            sizes.append(parse_bytes(item, what))
            continue
        experts = round(expert_amount(item, what, total, allow_bytes=False))
        if experts < 1:
            refuse(what, item, f"gives {experts} experts for a model with {total:,}")
        sizes.append(experts * expert_bytes if in_bytes else experts)
    if not sizes:
        refuse(what, text_value, "names no size")
    return sorted(set(sizes))


def budget_bytes(value, total_bytes: int, what: str, *, expert_bytes: int | None = None,
                 experts: int | None = None) -> int:
    """A memory budget in bytes, read as every budget option reads it (docs/budgets.md): a bare whole number
    is a number of experts (of ``expert_bytes`` each, at most ``experts``, all of the model's), a percentage
    (``30%``) or a fraction written with a decimal point (``0.3``) is a share of ``total_bytes`` (all experts),
    and bytes need a unit (``64MiB``, ``64MB``). Without ``expert_bytes`` a bare number is refused, naming
    the forms that are accepted."""
    item = value.strip() if isinstance(value, str) else value
    if isinstance(item, str) and (item.endswith("%") or re.fullmatch(r"0?\.[0-9]+|1\.0*", item)):
        return max(1, int(total_bytes * share(item, what)))
    if isinstance(item, float) and not isinstance(item, bool) and 0 < item <= 1 and item != int(item):
        return max(1, int(total_bytes * share(item, what)))
    if isinstance(item, str) and is_byte_size(item):
        return parse_bytes(item, what)
    if not expert_bytes:
        refuse(what, value, "give bytes with a unit (64MiB, 64MB) or a percentage (25%)")
    count = round(expert_amount(item, what, experts or max(1, total_bytes // expert_bytes), allow_bytes=False))
    return count * expert_bytes


# -------------------------------------------------------------------------------------------- ranges, jobs

def row_range(value: str | None, total: int, what: str) -> tuple[int, int]:
    """``START:END`` of ``total`` rows (either side may be empty; negative counts from the end)."""
    if value is None:
        return 0, total
    parts = str(value).split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        start = int(parts[0]) if parts[0].strip() else 0
        end = int(parts[1]) if parts[1].strip() else total
    except ValueError:
        refuse(what, value, "is not START:END (e.g. 0:150)")
    start, end = (start + total if start < 0 else start), (end + total if end < 0 else end)
    if not 0 <= start < end <= total:
        refuse(what, value, f"is not a non-empty range within the {total:,} rows")
    return start, end


def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def jobs(value, what: str = "--jobs") -> int:
    """Worker processes asked for: a whole number of at least 1 (``worker_count`` bounds what starts)."""
    return integer(value, what, low=1)


def worker_count(value, tasks: int, what: str = "--jobs") -> int:
    """Processes to start for ``tasks`` independent tasks when ``jobs(value)`` are asked for: never more than
    the tasks, nor than this machine's cores (more would only wait for each other), so a command or a test
    asking for 2 behaves the same on a machine of one core, with one process."""
    return max(1, min(jobs(value, what), tasks, cores()))


def memory(nbytes: int, what: str) -> None:
    """Refuse a computation that would allocate ``nbytes`` when this machine has less memory in all."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if nbytes > physical:
        raise ConfigError(f"{what} needs {format_bytes(nbytes)} of memory, more than this machine's "
                          f"{format_bytes(physical)}")


# ---------------------------------------------------------------------------------------- devices, context

_DEVICE = re.compile(r"^(cpu|cuda)(?::([0-9]+))?$")


def device(value, what: str = "--device") -> str:
    """A device of this machine that runs models: ``cpu``, ``cuda`` or ``cuda:N`` with CUDA present."""
    name = text(value, what).strip().lower()
    match = _DEVICE.match(name)
    if not match or (match.group(1) == "cpu" and match.group(2) is not None):
        refuse(what, value, "is not a device: cpu, cuda or cuda:N")
    if match.group(1) == "cpu":
        return "cpu"
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available == 0:
        refuse(what, value, "this machine (or this build of PyTorch) has no CUDA device; use cpu")
    if match.group(2) is not None and int(match.group(2)) >= available:
        refuse(what, value, f"this machine has {available} CUDA device(s), cuda:0 to cuda:{available - 1}")
    return name


def context_room(prompt_tokens: int, positions: int, what: str = "the prompt") -> int:
    """How many tokens can follow a prompt of ``prompt_tokens`` in a model of ``positions`` positions; a
    prompt longer than the context is refused."""
    if prompt_tokens > positions:
        raise ConfigError(f"{what} has {prompt_tokens:,} tokens, but the model reads at most {positions:,} "
                          f"positions: shorten it")
    return positions - prompt_tokens


def generation_length(max_new_tokens, prompt_tokens: int, positions: int,
                      what: str = "--max-new-tokens") -> int:
    """``max_new_tokens`` checked against the room the model's context leaves after the prompt."""
    count = integer(max_new_tokens, what, low=1)
    room = context_room(prompt_tokens, positions)
    if count > room:
        refuse(what, max_new_tokens, f"the prompt's {prompt_tokens:,} tokens and {count:,} new ones exceed the "
                                     f"model's {positions:,} positions: at most {room:,} new tokens fit")
    return count
