"""Replay throughput of every policy, Python and compiled, with libCacheSim's LRU, FIFO and Belady beside.

    python benchmarks/replay_throughput.py [--accesses 2000000] [--cache-fraction 0.25] [--repeat 3]
                                           [--python-repeat 1] [--policies lru,fifo,...]

The trace is a seeded Zipf trace of a Mixtral-shaped model (32 layers x 8 experts, top-2) written to Parquet,
read back and flattened as the replay simulator does (both timed); libCacheSim reads the same request
sequence from its oracleGeneral binary. For every policy it times the replay through the Python policy
object (``engine="python"``, best of --python-repeat) and, where the policy has a kernel, the compiled one
(``engine="compiled"``, best of --repeat), and checks that both make the same misses; for LRU, FIFO and
Belady it times libCacheSim (best of --repeat) and checks its misses too. Compile time is measured apart
from replay time: once with an empty Numba cache (a cold compile, the first run on a machine) and once in
a fresh process that loads the machine code from that cache (every later run).

Then the whole command against libCacheSim, at each of --command-accesses (default 2M and 20M requests) on a
Qwen3-30B-A3B-shaped Zipf trace (48 layers, top-8 of 128): `moe-offload simulate TRACE --policy P --cache-size
25% --json --jobs 1` timed in a fresh process, start to exit (imports, reading, flattening, the replay and
Belady's beside it on a second thread, the JSON), beside libCacheSim's in-process replay of the same sequence from its oracleGeneral file (reading
included), for LRU, FIFO and Belady, with the misses checked equal, the two taken in turns (--command-repeat
times, best of each). All ratios come from this one run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

LIBCACHESIM = {"lru": "LRU", "fifo": "FIFO", "belady": "Belady"}
MIN_COMPILED_RATE = 5e6     # requests/s every compiled policy must reach (issue 12)
MAX_BEHIND_LIBCACHESIM = 2  # LRU, FIFO and Belady may be at most this many times slower than libCacheSim

LOAD_FROM_CACHE = """
import sys, time
import numba  # imported first: its own import is not the kernels' loading
from moe_offload.policies import POLICIES
from moe_offload.simulator.kernels import compiled_kernel
for name in sys.argv[1:]:
    start = time.perf_counter()
    compiled_kernel(POLICIES[name].policy)
    print(name, time.perf_counter() - start)
"""


def rate(requests_per_second: float) -> str:
    millions = requests_per_second / 1e6
    return f"{millions:.2f}" if millions >= 0.1 else f"{millions:.3f}"


def best_time(function, repeat: int):
    best, value = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        value = function()
        best = min(best, time.perf_counter() - start)
    return best, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accesses", type=int, default=2_000_000)
    parser.add_argument("--cache-fraction", type=float, default=0.25)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each compiled and libCacheSim replay")
    parser.add_argument("--python-repeat", type=int, default=1, help="runs of each Python replay (0: none)")
    parser.add_argument("--policies", default=None,
                        help="comma-separated (default: every policy that runs without options, as 'all')")
    parser.add_argument("--command-accesses", default="2000000,20000000",
                        help="comma-separated request counts of the whole-command comparison ('' for none)")
    parser.add_argument("--command-repeat", type=int, default=5,
                        help="runs of the whole command and of libCacheSim's replay, taken in turns (best of each)")
    args = parser.parse_args()

    # An empty Numba cache for this run, set before Numba is imported: the first call compiles.
    numba_cache = tempfile.TemporaryDirectory(prefix="numba-cache-")
    os.environ["NUMBA_CACHE_DIR"] = numba_cache.name

    from moe_offload.policies import POLICIES, default_policies
    from moe_offload.simulator import kernels
    from moe_offload.simulator.replay import ReplayInput, replay
    from moe_offload.trace.flatten import write_oracle_general
    from moe_offload.trace.format import read_trace, write_trace
    from moe_offload.trace.synthetic import zipf_trace

    policies = args.policies.split(",") if args.policies else default_policies()
    layers, experts, top_k = 32, 8, 2
    tokens = max(1, args.accesses // (layers * top_k))
    console = Console(width=170)
    work_dir = tempfile.TemporaryDirectory(prefix="replay-throughput-")  # removed at exit
    work = Path(work_dir.name)
    trace_file = write_trace(zipf_trace(layers, experts, top_k, tokens, a=1.0, b=1.0, seed=0, shuffle=True),
                             work / "zipf.parquet")
    read_s, trace = best_time(lambda: read_trace(trace_file), 1)
    def flattened():
        data = ReplayInput.of(trace, name="zipf")
        data.sequence  # flattened when first asked for: asked for here, to time it
        return data

    flatten_s, data = best_time(flattened, 1)
    n = len(data.sequence)
    cache_size = max(top_k, round(args.cache_fraction * layers * experts))
    console.print(f"trace: Zipf a=1 b=1, {layers}x{experts} top-{top_k}, {tokens:,} tokens = {n:,} requests; cache "
                  f"{cache_size} experts; reading the Parquet file took {read_s:.3f} s, flattening {flatten_s:.3f} s")

    try:
        import libcachesim as lcs
    except ImportError:
        lcs = None
        console.print("libcachesim is not installed (pip install libcachesim): no reference timings")
    if not kernels.numba_available():
        console.print(f"Numba is not installed: no compiled timings ({kernels.INSTALL_HINT})")

    compiled = {name: POLICIES[name].policy for name in policies
                if kernels.numba_available() and POLICIES[name].policy.replay_kernel is not None}
    compile_s = {}
    for name, policy_class in compiled.items():
        start = time.perf_counter()
        kernels.compiled_kernel(policy_class)  # -dist variants share their policy's kernel: 0 s
        compile_s[name] = time.perf_counter() - start
    load_s = {}
    if compiled:
        lines = subprocess.run([sys.executable, "-c", LOAD_FROM_CACHE, *compiled], capture_output=True, text=True,
                               check=True, env=os.environ).stdout.split()
        load_s = {name: float(seconds) for name, seconds in zip(lines[::2], lines[1::2])}

    table = Table(title=f"replay throughput, M requests/s (Python: best of {args.python_repeat}; compiled and "
                        f"libCacheSim: best of {args.repeat})", title_justify="left")
    for column in ("policy", "misses", "Python", "compiled", "compiled / Python", "compile s (cold)",
                   "load s (cached)", "libCacheSim", "compiled / libCacheSim", "same misses"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    verdicts, slow = [], []
    oracle = work / "trace.oracleGeneral.bin"
    write_oracle_general(data.sequence, oracle, expert_bytes=None)
    for policy in policies:
        # --python-repeat 0 skips the Python replay (tens of minutes at 20M requests): the compiled one stands in
        python_s, result = best_time(lambda: replay(data, policy, cache_size, engine="python"), args.python_repeat)
        same = True
        fast_rate = None
        if policy in compiled:
            seconds, fast = best_time(lambda: replay(data, policy, cache_size, engine="compiled"), args.repeat)
            fast_rate = n / seconds
            if result is None:
                python_s, result = None, fast
            same &= fast.misses == result.misses and fast.per_layer_hits == result.per_layer_hits
        row = [policy, f"{result.misses:,}" if result else "-", rate(n / python_s) if result and python_s else "-"]
        if policy in compiled:
            info = POLICIES[policy]
            shared = f"{info.policy.name}'s" if info.partitioned else None  # a -dist policy runs its policy's kernel
            row += [rate(fast_rate), f"{python_s / seconds:.0f}x" if python_s else "-",
                    shared or f"{compile_s[policy]:.2f}", shared or f"{load_s[policy]:.3f}"]
            if fast_rate < MIN_COMPILED_RATE:
                slow.append(policy)
        else:
            row += ["-", "-", "-", "-"]
        if lcs is not None and policy in LIBCACHESIM:
            def run_reference():
                reader = lcs.TraceReader(str(oracle), lcs.TraceType.ORACLE_GENERAL_TRACE)
                return getattr(lcs, LIBCACHESIM[policy])(cache_size).process_trace(reader)[0]
            ref_seconds, miss_ratio = best_time(run_reference, args.repeat)
            same &= round(miss_ratio * n) == result.misses
            ratio = fast_rate * ref_seconds / n if fast_rate else None
            row += [rate(n / ref_seconds), f"{ratio:.2f}x" if ratio else "-"]
            if ratio:
                verdicts.append(f"{policy} {ratio:.2f}x")
                if ratio < 1 / MAX_BEHIND_LIBCACHESIM:
                    slow.append(f"{policy} (vs libCacheSim)")
        else:
            row += ["", ""]
        row.append("yes" if same else "NO")
        table.add_row(*row)
    console.print(table)
    if verdicts:
        console.print(f"compiled throughput / libCacheSim's: {', '.join(verdicts)} "
                      f"(the bar: at least 1/{MAX_BEHIND_LIBCACHESIM})")
    if compiled:
        console.print(f"every compiled policy at >= {MIN_COMPILED_RATE / 1e6:.0f} M requests/s and within "
                      f"{MAX_BEHIND_LIBCACHESIM}x of libCacheSim: "
                      + ("yes" if not slow else f"NO: {', '.join(slow)}"))


    if lcs is not None and args.command_accesses:
        for accesses in (int(text) for text in args.command_accesses.split(",")):
            whole_command(console, lcs, accesses, work, args.command_repeat)


def whole_command(console, lcs, accesses: int, work: Path, repeat: int) -> None:
    """`moe-offload simulate` start to exit against libCacheSim's replay of the same sequence (module doc), the
    two run in turns ``repeat`` times, so that a drift of the machine's speed meets both alike; best of each."""
    import json

    from moe_offload.simulator.replay import ReplayInput
    from moe_offload.trace.flatten import write_oracle_general
    from moe_offload.trace.format import write_trace
    from moe_offload.trace.synthetic import zipf_trace

    layers, experts, top_k = 48, 128, 8
    trace = zipf_trace(layers, experts, top_k, max(1, accesses // (layers * top_k)), a=1.2, b=0.0, seed=0,
                       shuffle=True)
    path = write_trace(trace, work / f"qwen3-shaped-{accesses}.parquet")
    data = ReplayInput.of(trace)
    n = len(data.sequence)
    oracle = write_oracle_general(data.sequence, work / f"qwen3-shaped-{accesses}.oracleGeneral.bin", None)
    del data, trace
    cache_size = layers * experts // 4
    table = Table(title=f"the whole command against libCacheSim: {n:,} requests, 48 x 128 top-8, {cache_size:,} "
                        f"experts (25%); seconds, best of {repeat} in turns", title_justify="left")
    for column in ("policy", "simulate (whole command)", "libCacheSim (replay)", "simulate / libCacheSim",
                   "same misses"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    command = [sys.executable, "-m", "moe_offload.cli.main", "simulate", str(path), "--cache-size", "25%", "--json",
               "--jobs", "1"]
    for policy in LIBCACHESIM:
        def run_command():
            done = subprocess.run(command + ["--policy", policy], capture_output=True, text=True, check=True)
            return next(r for r in json.loads(done.stdout) if r["policy"] == policy)["misses"]

        def run_reference():
            reader = lcs.TraceReader(str(oracle), lcs.TraceType.ORACLE_GENERAL_TRACE)
            return round(getattr(lcs, LIBCACHESIM[policy])(cache_size).process_trace(reader)[0] * n)

        ours_s = ref_s = float("inf")
        for _ in range(repeat):
            run_s, misses = best_time(run_command, 1)
            ours_s = min(ours_s, run_s)
            run_s, ref_misses = best_time(run_reference, 1)
            ref_s = min(ref_s, run_s)
        table.add_row(policy, f"{ours_s:.2f}", f"{ref_s:.2f}", f"{ours_s / ref_s:.2f}x",
                      "yes" if misses == ref_misses else "NO")
    console.print(table)


if __name__ == "__main__":
    main()
