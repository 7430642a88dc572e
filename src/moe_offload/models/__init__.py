"""Models: the adapters that tell the rest of the project how a Hugging Face MoE checkpoint is built, and the
bundled tiny Mixtral. Everything here needs the ``models`` extra (PyTorch, transformers, safetensors)."""

from __future__ import annotations

from moe_offload.errors import ConfigError


MODEL_STACK = ("torch", "transformers", "safetensors", "tokenizers", "xxhash")


def require_model_stack(what: str, modules: tuple[str, ...] = MODEL_STACK) -> None:
    """Fail with one clear line when PyTorch, transformers or another of ``modules`` is missing, before any
    work starts."""
    missing = []
    for module in modules:
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ConfigError(f"{what} needs {', '.join(missing)}, which is not installed: "
                          "pip install 'moe-offload[models]' (after `pip install torch==<version>` for a CPU build)")


def quiet_transformers() -> None:
    """transformers' own progress bars and advisory warnings would interleave with ours."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
