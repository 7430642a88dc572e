#!/usr/bin/env bash
# Set up the test environment (pytest, libcachesim, hypothesis, the openai client, CPU PyTorch, gguf and accelerate
# for GGUF checkpoints, Numba, Ray, the server's FastAPI, uvicorn and prometheus-client, MkDocs for the
# documentation build), check the package's import layers (lint-imports: pyproject.toml [tool.importlinter]) and
# run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh test,models,gguf,fast,ray,serve,docs
.venv/bin/lint-imports
exec .venv/bin/python -m pytest "$@"
