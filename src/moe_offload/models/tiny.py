"""The bundled tiny Mixtral and the one way a command resolves ``--model tiny|DIR|ORG/NAME[@REVISION]|FILE.gguf``."""

from __future__ import annotations

import os
from pathlib import Path

from moe_offload.bundled import TINY_MODEL_DIR
from moe_offload.errors import ConfigError
from moe_offload.models import quiet_transformers, require_model_stack
from moe_offload.models.adapters import load_model
from moe_offload.models.gguf import float_checkpoint, gguf_path, is_gguf
from moe_offload.models.hub import hub_id, resolve

TINY = "tiny"


def model_directory(name: str) -> Path:
    """``tiny`` is the bundled checkpoint; a hub id with no local path of that name is its snapshot in the hub
    cache, downloaded first where the hub is reachable (models/hub.py); a GGUF checkpoint (models/gguf.py) is its
    file, checked; anything else is a local directory."""
    if name == TINY:
        if not (TINY_MODEL_DIR / "model.safetensors").is_file():
            raise ConfigError(f"{TINY_MODEL_DIR}: the bundled model is missing from this installation "
                              "(rebuild it with `moe-offload train-tiny -o DIR` and pass --model DIR)")
        return TINY_MODEL_DIR
    if is_gguf(name):
        return gguf_path(name)[0]
    if hub_id(name) is not None:
        return resolve(name).directory
    return Path(name)


def cache_root() -> Path:
    """Where packed copies of models and the float checkpoints of GGUF files are kept: $MOE_OFFLOAD_CACHE, else
    $XDG_CACHE_HOME/moe-offload."""
    if os.environ.get("MOE_OFFLOAD_CACHE"):
        return Path(os.environ["MOE_OFFLOAD_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe-offload"


def load(name: str, dtype=None):
    """(model, adapter, tokenizer) for ``--model NAME``; errors name the missing or broken file."""
    require_model_stack("loading a model")
    quiet_transformers()
    directory = model_directory(name)
    if directory.is_file():  # a GGUF file: read through transformers into a float checkpoint first
        with float_checkpoint(directory, beside=cache_root()) as checkpoint:
            return _load(checkpoint, dtype)
    return _load(directory, dtype)


def _load(directory: Path, dtype):
    from transformers import AutoTokenizer

    model, adapter = load_model(directory, dtype=dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{directory}: no usable tokenizer (tokenizer.json): {str(exc).splitlines()[0]}") from None
    return model, adapter, tokenizer
