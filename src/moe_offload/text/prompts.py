"""Prompts for recording and generation: ShareGPT first human turns, HumanEval, or a user's file.

``load_prompts("sharegpt,humaneval", limit=20)`` takes up to ``limit`` prompts from each named source in
order. A ShareGPT turn is wrapped in the bundled model's chat format (``User: ...\\nAssistant:``) and cut to
``MAX_SHAREGPT_CHARS`` characters first, because some first turns are whole documents; a HumanEval prompt
(a signature and docstring) is used as is, for the model to complete the function. A file holds one prompt
per line, or JSON Lines whose objects carry ``prompt`` or ``text``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moe_offload.errors import ConfigError
from moe_offload.inputs import missing, parse_json, read_text
from moe_offload.text.sources import chat_prompt, humaneval_prompts, sharegpt_prompts
from moe_offload.values import integer

BUILTIN_SOURCES = ("sharegpt", "humaneval")
MAX_SHAREGPT_CHARS = 1200


@dataclass(frozen=True)
class Prompt:
    text: str
    source: str  # "sharegpt:12", "humaneval:HumanEval/3", "FILE:line 4"


def _from_file(path: Path) -> list[Prompt]:
    if missing(path):
        raise ConfigError(f"{path}: no such prompt file (and not one of {', '.join(BUILTIN_SOURCES)})")
    lines = read_text(path, "prompt file").splitlines()
    jsonl = path.suffix == ".jsonl"
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        text = line
        if jsonl:
            record = parse_json(line, path, "prompt line", row=number)
            text = record.get("prompt", record.get("text")) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ConfigError(f"{path}: line {number}: a JSON object with a 'prompt' or 'text' string is needed")
        prompts.append(Prompt(text, f"{path.name}:line {number}"))
    if not prompts:
        raise ConfigError(f"{path}: holds no prompt")
    return prompts


def load_prompts(spec: str, limit: int | None = None, skip: int = 0) -> list[Prompt]:
    """Prompts from a comma-separated list of sources (sharegpt, humaneval, or file paths): from each source,
    the prompts after its first ``skip``, at most ``limit`` of them."""
    if limit is not None:
        limit = integer(limit, "--limit", low=1)
    skip = integer(skip, "--skip", low=0)
    end = None if limit is None else skip + limit
    prompts: list[Prompt] = []
    for name in [part.strip() for part in spec.split(",") if part.strip()]:
        if name == "sharegpt":
            chosen = [Prompt(chat_prompt(text[:MAX_SHAREGPT_CHARS]), f"sharegpt:{i}")
                      for i, text in enumerate(sharegpt_prompts())][skip:end]
        elif name == "humaneval":
            chosen = [Prompt(text, f"humaneval:HumanEval/{i}") for i, text in enumerate(humaneval_prompts())][skip:end]
        else:
            chosen = _from_file(Path(name))[skip:end]
        prompts.extend(chosen)
    if not prompts:
        raise ConfigError(f"no prompts in {spec!r}")
    return prompts
