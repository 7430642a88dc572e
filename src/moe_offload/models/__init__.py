"""Models: the adapters that tell the rest of the project how a Hugging Face MoE checkpoint is built, and the
bundled tiny Mixtral. Everything here needs the ``models`` extra (PyTorch, transformers, safetensors)."""

from __future__ import annotations

from moe_offload.errors import ConfigError


MODEL_STACK = ("torch", "transformers", "safetensors", "tokenizers", "xxhash")
SERVE_STACK = ("fastapi", "uvicorn", "prometheus_client")  # the `serve` extra


def require_model_stack(what: str, modules: tuple[str, ...] = MODEL_STACK, *, serving: bool = False) -> None:
    """Fail with one clear line when PyTorch, transformers or another of ``modules`` is missing, before any
    work starts. ``serving``: the server's modules too, so that the line names every extra to install at once."""
    wanted = {"models": modules, "serve": SERVE_STACK if serving else ()}
    missing = {extra: [module for module in group if not _importable(module)] for extra, group in wanted.items()}
    names = [module for group in missing.values() for module in group]
    if not names:
        return
    extras = ",".join(extra for extra, group in missing.items() if group)
    cpu_torch = " (after `pip install torch==<version>` for a CPU build)" if "torch" in names else ""
    raise ConfigError(f"{what} needs {', '.join(names)}, which {'is' if len(names) == 1 else 'are'} not installed: "
                      f"pip install 'moe-offload[{extras}]'{cpu_torch}")


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def quiet_transformers() -> None:
    """transformers' own progress bars and advisory warnings would interleave with ours."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
