"""Every file the project reads: refused in one line that says what is wrong with it, never a traceback.

The counterpart of ``outputs.py``. ``check_input(path, what)`` tells apart the reasons a file cannot be read,
because each asks the user for something else: ``no such file``, ``is a directory``, ``symlink loop``,
``unreadable (permission denied)``, ``not a regular file`` (a FIFO would block the command forever, a device
would be read to its end). A file that opens but whose content is wrong is the reader's business: it says
``corrupt or truncated``, or what exactly is wrong, naming the file.

``read_bytes`` and ``read_text`` read a whole file through that check; ``parse_json`` turns text into JSON
and refuses, in one line, invalid JSON, JSON nested too deeply for the parser (Python raises RecursionError
there), the non-standard constants ``NaN`` and ``Infinity`` that Python's parser accepts by default, numbers
too large for a float (``1e400``, which Python would read as infinity) and integers of more digits than
Python converts; ``parse_toml`` does the same for TOML.

``check_memory`` refuses, before allocating, work whose arrays an input makes larger than this machine's
available memory (a history trace of 256 layers x 4,096 experts and thousands of requests).

Readers of traces raise :class:`~moe_offload.errors.TraceError`, readers of configuration files (profiles,
split configurations, prompt files, models) :class:`~moe_offload.errors.ConfigError`; both name the file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from pathlib import Path

from moe_offload.errors import ConfigError, TraceError


def fail(path, problem: str, error: type = ConfigError):
    """Raise ``error`` (ConfigError or TraceError) naming ``path`` and ``problem``."""
    if error is TraceError:
        raise TraceError(path, problem)
    raise error(f"{path}: {problem}")


def check_input(path, what: str = "file", error: type = ConfigError) -> Path:
    """``path`` as a Path if it is a regular file this process can read, else ``error`` in one line."""
    path = Path(path)
    try:
        info = os.stat(path)
    except OSError as exc:
        fail(path, _reason(exc, what), error)
    if stat.S_ISDIR(info.st_mode):
        fail(path, f"is a directory, not a {what}", error)
    if not stat.S_ISREG(info.st_mode):
        fail(path, f"is not a regular file (a {what} is read from a file)", error)
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError as exc:
        fail(path, _reason(exc, what), error)
    return path


def missing(path) -> bool:
    """Whether nothing is at ``path`` (a reader may then offer a hint); any other reason it cannot be read
    (a symlink loop, a name too long, no permission) is for ``check_input`` to tell."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno in (errno.ENOENT, errno.ENOTDIR)
    return False


def read_bytes(path, what: str = "file", error: type = ConfigError) -> bytes:
    path = check_input(path, what, error)
    try:
        return path.read_bytes()
    except OSError as exc:
        fail(path, _reason(exc, what), error)


def read_text(path, what: str = "file", error: type = ConfigError) -> str:
    """The file as UTF-8 text; a file that is not UTF-8 is refused with the offset of the first bad byte."""
    data = read_bytes(path, what, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        fail(path, f"not UTF-8 text (byte {exc.start}); is this really a {what}?", error)


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read a megabyte at a time (a pack's files, a GGUF checkpoint, a trace)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def parse_json(text: str | bytes, path, what: str = "file", error: type = ConfigError, row: int | None = None,
               unit: str = "line"):
    """``text`` parsed as standard JSON; anything else is ``error`` naming ``path`` (and ``row`` when given)."""
    def refuse(problem: str):
        if error is TraceError:
            raise TraceError(path, problem, row=row, unit=unit)
        raise error(f"{path}: " + (f"{unit} {row}: " if row is not None else "") + problem)

    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except _NonStandard as exc:
        refuse(exc.args[0])
    except RecursionError:
        refuse(f"JSON nested too deeply to be a {what}")
    except json.JSONDecodeError as exc:
        truncated = exc.pos >= len(exc.doc.rstrip())
        if row is None:  # name the line of the document, as an editor shows it
            row, unit = exc.lineno, "line"
        refuse(f"invalid JSON ({exc.msg}: column {exc.colno})"
               + ("; the text ends early: truncated?" if truncated else ""))
    except (ValueError, UnicodeDecodeError) as exc:  # bytes that are not UTF-8
        refuse(f"invalid JSON ({exc})")


class _NonStandard(ValueError):
    pass


def _refuse_constant(name: str):
    raise _NonStandard(f"{name} is not a JSON number (JSON has no NaN or infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _NonStandard(f"the number {text[:40]} is too large for a float")
    return value


def _reason(exc: OSError, what: str) -> str:
    code = exc.errno
    if code == errno.ENOENT:
        return "no such file"
    if code == errno.ELOOP:
        return "symlink loop (the link points back to itself)"
    if code in (errno.EACCES, errno.EPERM):
        return f"unreadable (permission denied): cannot read the {what}"
    if code == errno.ENOTDIR:
        return "no such file (a part of the path is not a directory)"
    if code == errno.EISDIR:
        return f"is a directory, not a {what}"
    if code == errno.ENAMETOOLONG:
        return "the file name is too long"
    return f"cannot read the {what}: {exc.strerror or exc}"


def parse_toml(text: str, path, what: str = "file", error: type = ConfigError) -> dict:
    """``text`` parsed as TOML; invalid or too deeply nested TOML is ``error`` naming ``path``."""
    import tomllib

    try:
        return tomllib.loads(text)
    except ValueError as exc:  # TOMLDecodeError, and integers longer than Python converts
        fail(path, f"not a valid TOML {what} ({exc})", error)
    except RecursionError:
        fail(path, f"TOML nested too deeply to be a {what}", error)


def available_memory() -> int:
    """Bytes this machine can still give a process without swapping: MemAvailable from /proc/meminfo, else
    the physical memory."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(needed: int, path, what: str, error: type = ConfigError) -> None:
    """``error`` naming ``path`` when ``what`` needs ``needed`` bytes, more than the memory available: refused in
    one line before the allocation, instead of a MemoryError (or the system swapping) minutes in."""
    free = available_memory()
    if needed > free:
        fail(path, f"{what} would need {needed / 2**30:,.1f} GiB of memory, and {free / 2**30:,.1f} GiB is "
                   "available", error)
