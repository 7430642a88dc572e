"""``--model ORG/NAME[@REVISION]``: a checkpoint on the Hugging Face hub, resolved through ``huggingface_hub``.

The hub's own client does the resolving, so its cache layout and settings hold unchanged: the snapshot lives in
``$HF_HUB_CACHE`` (by default ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``) as
``models--ORG--NAME/snapshots/<commit>/...`` with ``refs/<branch>`` naming a branch's commit;
``HF_HUB_OFFLINE=1`` reads that cache and never the network; ``@REVISION`` is a branch, tag or commit. Where the
hub is reachable the missing files are downloaded (only what the runtime reads: config, safetensors weights,
tokenizer), where it is not the cached snapshot is used, and otherwise the command stops with one line that
names the id and what is missing, before any work.

A name is a hub id only when no local path of that name exists (a local directory always wins) and it has the
hub's form, one ``/`` between two names of letters, digits, ``-``, ``_`` and ``.``, as huggingface_hub's own
``validate_repo_id`` rules it (utils/_validators.py: at most 96 characters each, no ``--`` or ``..``, not ending
in ``.git``). A revision follows git's rules for a ref name (``git check-ref-format``): components separated by
single ``/``, none empty, none beginning with ``.`` or ending in ``.lock``, no ``..``; the hub client reads a
branch's commit from the file ``refs/<revision>`` of its cache, so a revision such as ``../../elsewhere/ref``
would otherwise name a file outside it. The snapshot it resolves to must be ``snapshots/<40-hex commit>`` of
the repository's cache folder: a ref file holding a path instead of a commit is refused too.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from moe_offload.errors import ConfigError

HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9](?:[\w.-]{0,94}\w)?/[A-Za-z0-9](?:[\w.-]{0,94}\w)?)"
                    r"(?:@(?P<revision>[\w.\-/]{1,255}))?")
COMMIT = re.compile(r"[0-9a-f]{40}")
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
    match = HUB_ID.fullmatch(name)
    if match is None or "--" in match["repo"] or ".." in match["repo"] or match["repo"].endswith(".git"):
        return None
    try:
        if Path(name).exists():
            return None
    except OSError:  # a path the system cannot even look up is no local directory
        pass
    return match["repo"], match["revision"]


def _check_revision(name: str, revision: str | None) -> None:
    """ConfigError unless ``revision`` is a git ref name (module docstring), so that it stays in the cache."""
    if revision is None:
        return
    parts = revision.split("/")
    if any(not part or part.startswith(".") or part.endswith(".lock") for part in parts) or ".." in revision:
        raise ConfigError(f"--model {name}: revision {revision!r} is not a branch, tag or commit name (git's rules: "
                          "no empty part, no part beginning with '.' or ending in '.lock', no '..')")


def _in_cache(name: str, repo_id: str, snapshot: Path) -> None:
    """ConfigError unless ``snapshot`` is ``snapshots/<commit>`` of ``repo_id``'s folder in the hub cache (a ref
    file holding a path, not a commit, would lead anywhere)."""
    from huggingface_hub import constants

    snapshots = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    if not COMMIT.fullmatch(snapshot.name) or os.path.realpath(snapshot.parent) != os.path.realpath(snapshots):
        raise ConfigError(f"--model {name}: the hub cache resolves it to {snapshot}, which is not a commit's "
                          f"snapshot in {snapshots} (a corrupt ref file?); download it again (`hf download "
                          f"{repo_id}`)")


def resolve(name: str) -> HubCheckpoint:
    """The snapshot of the hub checkpoint ``name`` (see the module docstring); ConfigError in one line naming
    ``name`` and what is missing when it is neither cached nor downloadable, or lacks the files a run needs."""
    from huggingface_hub import snapshot_download

    parsed = hub_id(name)
    if parsed is None:
        raise ConfigError(f"--model {name}: not a hub id (ORG/NAME[@REVISION])")
    repo_id, revision = parsed
    _check_revision(name, revision)
    with _hub_errors(name, repo_id, revision):
        snapshot = Path(snapshot_download(repo_id, revision=revision, allow_patterns=CHECKPOINT_PATTERNS))
    _in_cache(name, repo_id, snapshot)
    if not (snapshot / "config.json").is_file():
        raise ConfigError(f"--model {name}: the snapshot {snapshot} has no config.json (not a transformers "
                          "checkpoint, or an incomplete download)")
    if not any(snapshot.glob("*.safetensors")):
        raise ConfigError(f"--model {name}: the snapshot {snapshot} has no *.safetensors weights (only safetensors "
                          "checkpoints are read)")
    return HubCheckpoint(repo_id, revision, snapshot.name, snapshot)


def resolve_file(name: str, repo_id: str, revision: str | None, filename: str) -> tuple[Path, str]:
    """(path in the hub cache, commit) of the one file ``filename`` of a hub repository (a GGUF file, which
    holds a whole checkpoint), cached or downloaded exactly as :func:`resolve` treats a snapshot; ``name`` is
    what the user gave, for the error lines."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError

    _check_revision(name, revision)
    with _hub_errors(name, repo_id, revision):
        try:
            path = Path(hf_hub_download(repo_id, filename, revision=revision))
        except RemoteEntryNotFoundError:  # the hub answered; not in the cache offline is _hub_errors'
            raise ConfigError(f"--model {name}: the hub repository {repo_id} has no file {filename}") from None
    # the cache keeps a file at snapshots/<commit>/<filename>: the commit pins its content
    snapshot = path.parents[len(Path(filename).parts) - 1]
    _in_cache(name, repo_id, snapshot)
    return path, snapshot.name


@contextmanager
def _hub_errors(name: str, repo_id: str, revision: str | None):
    """The hub client's errors as one line each that names ``name`` and what is missing."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    offline = huggingface_hub.is_offline_mode()
    try:
        yield
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
