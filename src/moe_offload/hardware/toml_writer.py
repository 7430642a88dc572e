"""Hardware profiles as TOML files: the writer (tomllib only reads), in the presets' layout, so that a
measured profile (``moe-offload hardware measure``) reads like a preset."""

from __future__ import annotations

import math
from pathlib import Path

from moe_offload.outputs import write_atomically


def _toml_string(text: str) -> str:
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\u{ord(char):04X}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            raise ValueError("TOML profiles hold no NaN")
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value != 0 and not 1e-3 <= abs(value) < 1e5:  # 1.567e+08, as the presets write rates, not 156700000.0
            import numpy as np

            return np.format_float_scientific(value, unique=True, trim="-")  # shortest text that reads back exact
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{key} = {_toml_value(v)}" for key, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() and key.isascii() else _toml_string(key)


def profile_toml(profile: dict, header: str = "") -> str:
    """The profile dict as TOML in the presets' layout: top-level keys, ``sources`` one per line, then the
    [[tiers]], [[links]] and [compute] tables (tomllib only reads, and this structure is all a profile has)."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for key, value in profile.items():
        if key in ("tiers", "links", "compute"):
            continue
        if key == "sources":
            lines += ["sources = ["] + [f"  {_toml_string(s)}," for s in value] + ["]"]
        else:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for array in ("tiers", "links"):
        for table in profile.get(array, []):
            lines += ["", f"[[{array}]]"] + [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()]
    if "compute" in profile:
        lines += ["", "[compute]"] + [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in profile["compute"].items()]
    return "\n".join(lines) + "\n"


def write_profile(profile: dict, path, header: str = "") -> Path:
    """Write the profile's TOML atomically (a failed write leaves an existing file as it was)."""
    return write_atomically(path, profile_toml(profile, header))
