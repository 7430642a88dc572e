#!/usr/bin/env bash
# Set up the test environment (pytest, libcachesim, hypothesis, CPU PyTorch) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh test,models
exec .venv/bin/python -m pytest "$@"
