#!/usr/bin/env bash
# Create .venv and install moe-offload into it. Usage: bash scripts/setup-env.sh [EXTRAS], e.g. "test,models".
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if [[ ",$extras," == *",models,"* ]]; then
    # Pinned first so that the 'models' extra's torch>=2.4 is already met by the CPU build here,
    # instead of pulling the registry's newest CUDA build (gigabytes).
    .venv/bin/python -m pip install -qq "torch==2.13.0"
fi
.venv/bin/python -m pip install -qq -e ".${extras:+[$extras]}"
