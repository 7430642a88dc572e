"""Errors a user can act on. The CLI prints them in one line instead of a traceback."""

from __future__ import annotations


class MoeOffloadError(Exception):
    """Base class of every error the project raises on purpose."""


class TraceError(MoeOffloadError):
    """A trace file is missing, corrupt, truncated or inconsistent.

    The message names the file, the row (or line) when one is to blame, and the problem.
    """

    def __init__(self, path, problem: str, row: int | None = None, unit: str = "row"):
        self.path = str(path)
        self.row = row
        self.problem = problem
        where = f"{self.path}: {unit} {row}: " if row is not None else f"{self.path}: "
        super().__init__(where + problem)


class ConfigError(MoeOffloadError):
    """An option or parameter that cannot work (unknown policy, cache smaller than top-k, ...)."""
