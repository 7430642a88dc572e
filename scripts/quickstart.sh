#!/usr/bin/env bash
# Set everything up and run the main job:
#  1. the report a user gets for their own traffic, here the bundled OLMoE trace with a quarter of its experts
#     in fast memory: every eviction policy beside Belady's optimum (policy or working set?), the latency on a
#     desktop GPU, the settings of one serving engine, what to run (out/report.html). Kept to seconds: the timed
#     runs cover the trace's first 64 tokens and one engine's settings are scored (the report says both), and
#     the replay runs the policies in Python, as Numba's first compile of every kernel (once per machine: 36 s
#     of CPU measured on a loaded 2-core machine) costs more than it saves on this short trace (4 s of CPU). The command
#     of the whole report is printed at the end;
#  2. the runtime: the bundled tiny Mixtral answers a prompt with a quarter of its experts in the fast tier,
#     streaming the text, then its speed, hit rate and traffic. It computes on one PyTorch thread: on a busy
#     machine a second thread's OpenMP team waits to be woken at every operation (runtime/cpu_threads.py);
#     measured on a 2-core machine at load 2.7-3.5, 10.7-11.1 s of CPU and a TPOT of 66-69 ms on one thread
#     against 15.6-16.4 s and 154-162 ms on PyTorch's default of two. The tiny model is a toy trained in minutes on a
#     CPU so that the runtime runs anywhere: its text is not meant to make sense (generate says so too).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh models,fast
.venv/bin/moe-offload report olmoe --fast-memory 25% --timed-tokens 64 --engine vllm --replay-engine python \
    -o out/report.html
.venv/bin/moe-offload generate --chat --fast-budget 25% --policy lcp --prefetch moepic --max-new-tokens 48 \
    --threads 1 "How do I read a file line by line in Python?"
echo "the whole report (the latency on all 299 tokens, every engine's settings; about a minute):"
echo "  .venv/bin/moe-offload report olmoe --fast-memory 25% -o out/report.html"
echo "every policy at every cache size, with the plot of docs/figures/olmoe-misses.png (a few minutes):"
echo "  .venv/bin/moe-offload simulate --plot out/misses.png"
