"""The codes of a trace row's ``phase`` column (trace-format.md): 0 for a prefill token, 1 for a decode step.

They sit below format.py, which writes and reads them, and validate.py, which checks them, so the format can
call its checks without the checks importing the format."""

from __future__ import annotations

PHASES = ("prefill", "decode")
PREFILL, DECODE = 0, 1
