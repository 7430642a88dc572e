"""``--model ORG/NAME[@REVISION]``: a checkpoint on the Hugging Face hub, resolved through ``huggingface_hub``.

The hub's own client does the resolving, so its cache layout and settings hold unchanged: the snapshot lives in
``$HF_HUB_CACHE`` (by default ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``) as
``models--ORG--NAME/snapshots/<commit>/...`` with ``refs/<branch>`` naming a branch's commit;
``HF_HUB_OFFLINE=1`` reads that cache and never the network; ``@REVISION`` is a branch, tag or commit. Where the
hub is reachable the missing files are downloaded (only what the runtime reads: config, safetensors weights,
tokenizer), where it is not the cached snapshot is used, and otherwise the command stops with one line that
names the id and what is missing, before any work.

A name is a hub id only when no local path of that name exists (a local directory always wins) and it has the
hub's form, one ``/`` between two names of letters, digits, ``-``, ``_`` and ``.``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from moe_offload.errors import ConfigError

HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w.\-/]+))?")
# What the runtime reads from a checkpoint; a repository's other files (PyTorch .bin copies, ONNX, GGUF) are
# never downloaded.
CHECKPOINT_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                       "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                       "merges.txt", "tokenizer.model", "chat_template.jinja"]


@dataclass(frozen=True)
class HubCheckpoint:
    """A hub checkpoint resolved to its snapshot directory in the hub cache."""

    repo_id: str
    revision: str | None  # as given after ``@`` (None: the default branch)
    commit: str           # the commit the snapshot holds: what a pack made from it is keyed by
    directory: Path


def hub_id(name: str) -> tuple[str, str | None] | None:
    """(repository, revision or None) when ``--model NAME`` names a hub checkpoint, else None."""
    if Path(name).exists():
        return None
    match = HUB_ID.fullmatch(name)
    return (match["repo"], match["revision"]) if match else None


def resolve(name: str) -> HubCheckpoint:
    """The snapshot of the hub checkpoint ``name`` (see the module docstring); ConfigError in one line naming
    ``name`` and what is missing when it is neither cached nor downloadable, or lacks the files a run needs."""
    import huggingface_hub
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    parsed = hub_id(name)
    if parsed is None:
        raise ConfigError(f"--model {name}: not a hub id (ORG/NAME[@REVISION])")
    repo_id, revision = parsed
    offline = huggingface_hub.is_offline_mode()
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, allow_patterns=CHECKPOINT_PATTERNS))
    except RevisionNotFoundError:
        raise ConfigError(f"--model {name}: the hub repository {repo_id} has no revision {revision!r}") from None
    except GatedRepoError:
        raise ConfigError(f"--model {name}: {repo_id} is gated on the hub: accept its terms on its page and log "
                          "in (`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"--model {name}: no local directory of that name, and no repository {repo_id} on the "
                          "hub (or a private one: log in with `hf auth login`)") from None
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        at = f"@{revision}" if revision else ""
        raise ConfigError(f"--model {name}: no local directory of that name, {repo_id}{at} is not in the hub cache "
                          f"{constants.HF_HUB_CACHE} and {where}: download it where the hub is reachable "
                          f"(`hf download {repo_id}`)") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ConfigError(f"--model {name}: {repo_id}: {str(exc).strip().splitlines()[0]}") from None
    if not (snapshot / "config.json").is_file():
        raise ConfigError(f"--model {name}: the snapshot {snapshot} has no config.json (not a transformers "
                          "checkpoint, or an incomplete download)")
    if not any(snapshot.glob("*.safetensors")):
        raise ConfigError(f"--model {name}: the snapshot {snapshot} has no *.safetensors weights (only safetensors "
                          "checkpoints are read)")
    return HubCheckpoint(repo_id, revision, snapshot.name, snapshot)
