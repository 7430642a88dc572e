"""How long the whole `moe-offload report` takes on a large trace, and its peak memory, against one libCacheSim LRU
replay of the same request sequence.

    python benchmarks/report_scale.py [--tokens 20000] [--layers 48] [--experts 128] [--top-k 8]
        [--fast-memory 25%] [--jobs 2] [--expert-bytes BYTES] [--sample-above N] [--exact] [--html FILE]
        [--repeat 3] [--kernels]

The trace is synthetic: Zipf-popular experts per layer (paper 001's section 5.1 law, a = 1.2, each layer its
own popularity order), requests of 256 decode tokens one after the other, Qwen3-30B-A3B's shape by default (48
layers, top-8 of 128), written to a Parquet file. 20,000 tokens are 7.7M requests; 100,000 are 38.4M; a
million tokens, a day of one vLLM instance, 384M (ten copies of 100,000 tokens one after the other):

    python benchmarks/report_scale.py --tokens 100000 --copies 10

With --kernels it then replays the trace at the report's budget through each compiled policy alone, in this
process, one after the other, and prints their times, the largest first: what the report's CPU goes to.

The report runs as a user runs it, `moe-offload report TRACE --fast-memory 25%` in a process of its own (reading
the file included), timed start to exit, its peak resident memory read from the kernel's accounting of that
process (``wait4``). Without --expert-bytes the trace gives no expert size, so the report has no latency section
(the timed simulator's runs are their own benchmark); with it, the budget must fit the default hardware
profile's GPU, as `moe-offload report` checks. Then libCacheSim's LRU replays the same sequence from its
oracleGeneral file (written a piece at a time; LRU does not read the file's next-access times, which are left
out), in this process, with reading the file included. The two run in turns --repeat times (3 by default), so that
a drift of the machine's speed moves both sides of the ratio alike, and the best time of each is kept (the report's
steps are those of its best run; its peak memory the largest of its runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pty
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

REQUEST_TOKENS = 256


def synthetic_trace(tokens: int, layers: int, experts: int, top_k: int, expert_bytes: int | None, copies: int = 1):
    """The Zipf trace of ``tokens`` tokens, ``copies`` times one after the other (drawing a million tokens
    without replacement takes longer than the report)."""
    import numpy as np

    from moe_offload.trace.format import Trace
    from moe_offload.trace.synthetic import zipf_trace

    base = zipf_trace(layers, experts, top_k, tokens, a=1.2, b=0.0, seed=0, shuffle=True)
    rows = np.arange(tokens * copies)
    meta = replace(base.meta, expert_bytes=expert_bytes)
    return Trace.build(meta, np.concatenate([base.experts] * copies), request=rows // REQUEST_TOKENS,
                       position=rows % REQUEST_TOKENS, path="synthetic-zipf")


def write_lru_oracle(trace, path: Path) -> int:
    """The trace's request sequence as libCacheSim's oracleGeneral records, a piece at a time; the next-access
    time, which LRU never reads, is -1. Returns the number of requests."""
    import numpy as np

    from moe_offload.trace.flatten import ORACLE_GENERAL_RECORD, flattened_pieces

    written = 0
    with open(path, "wb") as out:
        for keys in flattened_pieces(trace):
            records = np.empty(keys.size, ORACLE_GENERAL_RECORD)
            records["clock_time"] = np.arange(written, written + keys.size, dtype=np.uint64).astype(np.uint32)
            records["obj_id"] = keys
            records["obj_size"] = 1
            records["next_access_vtime"] = -1
            records.tofile(out)
            written += keys.size
    return written


ANSI = re.compile(r"\x1b\[[0-9;]*m")
RSS_EVERY_S = 0.05  # how often the report's resident memory is read (/proc/PID/status)


@dataclass
class Phase:
    """One step of the report (its progress line), with the seconds it took and the largest resident memory
    sampled during it."""

    name: str
    start: float
    seconds: float = 0.0
    peak: int = 0


def resident_bytes(pid: int) -> int:
    """The resident memory of process ``pid`` now (VmRSS), 0 once it has gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_report(command: list[str], work: Path) -> tuple[float, int, str, list[Phase]]:
    """(seconds, peak resident bytes, stdout, phases) of the report's process, start to exit: waited for with
    ``wait4``, which returns the process's own resource accounting. Its stderr is a terminal (a pseudo-terminal
    read here), so the report prints a progress line before each step; its resident memory is sampled every
    RSS_EVERY_S and the peak of each step kept (the first step: imports and reading the trace)."""
    out = open(Path(work) / "report.out", "w+")
    controller, terminal = pty.openpty()
    start = time.perf_counter()
    # a wide terminal: a progress line is never wrapped (COLUMNS sets the width rich assumes)
    process = subprocess.Popen(command, stdout=out, stderr=terminal, text=True, env={**os.environ, "COLUMNS": "400"})
    os.close(terminal)
    phases = [Phase("start: imports, reading and checking the trace", 0.0)]
    errors: list[str] = []

    def read_steps() -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # the report has exited: the terminal is closed
                break
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                text = ANSI.sub("", line.decode(errors="replace")).strip()
                if text.endswith("..."):
                    phases.append(Phase(text[:-3], time.perf_counter() - start))
                elif text:
                    errors.append(text)

    reader = threading.Thread(target=read_steps, daemon=True)
    reader.start()
    while True:  # wait4 reaps the process and gives its own accounting: its peak resident memory
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            break
        phases[-1].peak = max(phases[-1].peak, resident_bytes(process.pid))
        time.sleep(RSS_EVERY_S)
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    seconds = time.perf_counter() - start
    reader.join(timeout=5)
    os.close(controller)
    for phase, following in zip(phases, phases[1:] + [Phase("", seconds)]):
        phase.seconds = following.start - phase.start
    out.seek(0)
    if process.returncode != 0:
        raise SystemExit(f"the report failed: {' '.join(errors)}")
    return seconds, usage.ru_maxrss * 1024, out.read(), phases  # kilobytes on Linux


def lru_reference(oracle: Path, cache_size: int) -> float:
    """Seconds of libCacheSim's LRU replay of the oracleGeneral file ``oracle`` at ``cache_size``, reading the
    file included, in a process of its own: the file's pages it maps would otherwise stay in this process and,
    copied into the report's at its start, count in the report's peak memory (``wait4``'s high-water mark spans
    the fork)."""
    script = ("import sys, time\nimport libcachesim as lcs\nstart = time.perf_counter()\n"
              "reader = lcs.TraceReader(sys.argv[1], lcs.TraceType.ORACLE_GENERAL_TRACE)\n"
              "lcs.LRU(int(sys.argv[2])).process_trace(reader)\nprint(time.perf_counter() - start)\n")
    done = subprocess.run([sys.executable, "-c", script, str(oracle), str(cache_size)], capture_output=True,
                          text=True, check=True)
    return float(done.stdout)


def time_kernels(trace, cache_size: int) -> None:
    """Each compiled policy of the report, and Belady, replayed alone at ``cache_size``, the tokens column made
    first, on one thread: seconds, the largest first, and their sum."""
    from moe_offload.reporting.bound import online_policies
    from moe_offload.simulator.replay import ReplayInput, load_kernels, replay, replay_kernel

    data = ReplayInput.of(trace, checked=True)
    policies = ["belady"] + [policy for policy in online_policies() if replay_kernel(policy) is not None]
    load_kernels(policies)
    sequence = data.sequence
    sequence.token  # made once, before the timings, as the report makes it before its replays
    seconds = {}
    for policy in policies:
        start = time.perf_counter()
        replay(data, policy, cache_size)
        seconds[policy] = time.perf_counter() - start
    print(f"each compiled policy alone at {cache_size:,} experts, one thread ({sum(seconds.values()):.1f} s in all):")
    for policy, spent in sorted(seconds.items(), key=lambda item: -item[1]):
        print(f"  {spent:7.2f} s  {len(sequence) / spent / 1e6:6.1f} M requests/s  {policy}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--copies", type=int, default=1, help="the trace is this many copies of --tokens tokens")
    parser.add_argument("--fast-memory", default="25%")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--expert-bytes", help="bytes of one expert: adds the latency section (default none)")
    parser.add_argument("--sample-above", default=None, help="as `report --sample-above`")
    parser.add_argument("--exact", action="store_true", help="as `report --exact`")
    parser.add_argument("--html", metavar="FILE", help="also write the report's page")
    parser.add_argument("--repeat", type=int, default=3,
                        help="run the report and libCacheSim's replay in turns this many times, keep the best of each")
    parser.add_argument("--kernels", action="store_true",
                        help="then time each compiled policy's replay at the budget alone, in this process")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: must be at least 1")

    from moe_offload.cli.report_cmd import fast_memory_experts
    from moe_offload.trace.format import read_trace, write_trace
    from moe_offload.values import parse_bytes

    expert_bytes = parse_bytes(args.expert_bytes, "--expert-bytes") if args.expert_bytes else None
    with tempfile.TemporaryDirectory(prefix="report-scale-") as work:
        start = time.perf_counter()
        trace = synthetic_trace(args.tokens, args.layers, args.experts, args.top_k, expert_bytes, args.copies)
        path = write_trace(trace, Path(work) / "synthetic-zipf.parquet")
        requests = trace.num_tokens * args.layers * args.top_k
        cache_size = fast_memory_experts(args.fast_memory, trace.meta.num_expert_slots, args.top_k, expert_bytes)
        print(f"{trace.num_tokens:,} tokens ({args.copies} x {args.tokens:,}) x {args.layers} layers x top-{args.top_k} of {args.experts} experts: "
              f"{requests:,} expert requests, written in {time.perf_counter() - start:.1f} s", flush=True)
        command = [sys.executable, "-m", "moe_offload.cli.main", "report", str(path), "--fast-memory",
                   args.fast_memory, "--jobs", str(args.jobs)]
        command += ["--expert-bytes", args.expert_bytes] if args.expert_bytes else []
        command += ["--sample-above", args.sample_above] if args.sample_above else []
        command += ["--exact"] if args.exact else []
        command += ["-o", args.html] if args.html else []
        oracle = Path(work) / "trace.oracleGeneral.bin"
        written = write_lru_oracle(trace, oracle)
        assert written == requests
        has_libcachesim = importlib.util.find_spec("libcachesim") is not None
        del trace  # this process's memory would count in the report's peak (lru_reference)
        # in turns, so that a drift of the machine's speed moves both sides of the ratio alike
        runs, references = [], []
        for turn in range(args.repeat):
            runs.append(run_report(command, Path(work)))
            if has_libcachesim:
                references.append(lru_reference(oracle, cache_size))
            print(f"turn {turn + 1}: the report {runs[-1][0]:.2f} s, peak {runs[-1][1] / 2**30:.2f} GiB"
                  + (f"; libCacheSim LRU {references[-1]:.2f} s" if references else ""), flush=True)
        if args.kernels:
            time_kernels(read_trace(path), cache_size)
    seconds, _, stdout, phases = min(runs, key=lambda run: run[0])
    peak = max(run[1] for run in runs)
    print(stdout)
    for phase in phases:
        print(f"  {phase.seconds:8.1f} s  peak {phase.peak / 2**30:5.2f} GiB  {phase.name}")
    best = f"best of {args.repeat}: " if args.repeat > 1 else ""
    if not references:
        print(f"the whole report, {best}{seconds:.2f} s; libcachesim is not installed (pip install libcachesim): "
              "no reference")
        return 0
    reference = min(references)
    print(f"the whole report, {best}{seconds:.2f} s, peak resident memory {peak / 2**30:.2f} GiB ({peak / requests:.1f} "
          f"bytes per request, the largest of the runs); one libCacheSim LRU replay of the same sequence, {best}"
          f"{reference:.2f} s; the report took {seconds / reference:.1f} of them")
    return 0


if __name__ == "__main__":
    from script import run

    run(main)
