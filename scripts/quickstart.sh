#!/usr/bin/env bash
# Set everything up and run the main job: every eviction policy on the bundled OLMoE trace,
# a table at a few cache sizes and a plot of misses against cache size (out/misses.png).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
.venv/bin/moe-offload simulate --plot out/misses.png "$@"
