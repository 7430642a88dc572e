#!/usr/bin/env bash
# Set up the test environment (pytest, libcachesim, hypothesis, CPU PyTorch, Numba, Ray) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh test,models,fast,ray
exec .venv/bin/python -m pytest "$@"
