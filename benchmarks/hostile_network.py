"""The slow hostile-server cases of ``trace capture`` at full size, each run as the command a user runs: a
server that drips one byte every 2 s (the answer, and the model list), one that sends an endless answer, one
that declares a 1 GB answer, one whose error body is 1 GB, and one that never answers.

    python benchmarks/hostile_network.py [--drip-interval 2] [--timeout 120] [--read-timeout 60]
        [--max-response 256MiB] [--cases drip,models-drip,endless,huge-declared,huge-error,silent] [--json FILE]

Each case is ``moe-offload trace capture`` in its own process against a server of tests/hostile_servers.py on
127.0.0.1 (a daemon thread of this process, stopped when the case ends), with the given limits (the
command's defaults but ``--timeout``, lowered from 600 s so that the silent case ends in minutes). Reported
per case: exit status, wall time, the child's peak resident memory (``wait4``), stderr's bytes and lines and
its message. Checked (exit status 1 if any fails): exit status 2, one line of under 1,000 bytes, no trace
written, a wall time within the deadline that applies plus 15 s, a peak resident set under the answer cap
plus 400 MiB (the interpreter and its imports).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the scripted servers of the tests

CASES = {  # name -> (behaviour, models answered properly first, which deadline ends it)
    "drip": ("drip", True, "read"),
    "models-drip": ("drip", False, "read"),
    "endless": ("endless", True, "read"),
    "huge-declared": ("huge-declared", True, "read"),
    "huge-error": ("huge-error", True, "read"),
    "silent": ("silent", True, "total"),
}
OVERHEAD_MIB = 400
SLACK_SECONDS = 15


def run_case(name: str, args, max_bytes: int) -> dict:
    from hostile_servers import ScriptedServer

    behaviour, models_first, deadline = CASES[name]
    limit = args.read_timeout if deadline == "read" else args.timeout
    with tempfile.TemporaryDirectory() as folder, \
            ScriptedServer(behaviour, models_first=models_first, interval=args.drip_interval,
                           hold=args.timeout + SLACK_SECONDS) as server:
        prompts = Path(folder) / "prompts.txt"
        prompts.write_text("hello\n")
        output = Path(folder) / "t.parquet"
        command = [sys.executable, "-m", "moe_offload.cli.main", "trace", "capture", "--url", server.url,
                   "--prompts", str(prompts), "--model-config", "tiny", "--timeout", str(args.timeout),
                   "--read-timeout", str(args.read_timeout), "--max-response", args.max_response, "-o", str(output)]
        started = time.perf_counter()
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        stderr = child.stderr.read()
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        written = output.exists()
    code = os.waitstatus_to_exitcode(status)
    peak = usage.ru_maxrss / 1024
    text = stderr.decode("utf-8", errors="replace")
    problems = [problem for failed, problem in (
        (code != 2, f"exit status {code}"), (text.count("\n") != 1, f"{text.count(chr(10))} lines on stderr"),
        (len(stderr) >= 1000, f"{len(stderr):,} bytes on stderr"), (written, "a trace was written"),
        (wall > limit + SLACK_SECONDS, f"{wall:.0f} s, past the {limit:g} s deadline"),
        (peak > max_bytes / 2**20 + OVERHEAD_MIB, f"peak resident {peak:.0f} MiB")) if failed]
    return {"case": name, "exit_status": code, "seconds": round(wall, 2), "peak_resident_mib": round(peak),
            "stderr_bytes": len(stderr), "stderr_lines": text.count("\n"), "message": text.strip()[-400:],
            "deadline_s": limit, "problems": problems}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drip-interval", default="2", metavar="SECONDS", help="seconds between dripped bytes")
    parser.add_argument("--timeout", default="120", metavar="SECONDS", help="capture's --timeout (default 120)")
    parser.add_argument("--read-timeout", default="60", metavar="SECONDS",
                        help="capture's --read-timeout (default 60, the command's)")
    parser.add_argument("--max-response", default="256MiB", metavar="BYTES",
                        help="capture's --max-response (default 256MiB, the command's)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)

    from moe_offload import values
    from moe_offload.outputs import check_output, write_atomically

    args.drip_interval = values.number(args.drip_interval, "--drip-interval", low=0, low_open=True)
    args.timeout = values.number(args.timeout, "--timeout", low=0, low_open=True)
    args.read_timeout = values.number(args.read_timeout, "--read-timeout", low=0, low_open=True)
    max_bytes = values.parse_bytes(args.max_response, "--max-response")
    cases = [name.strip() for name in args.cases.split(",") if name.strip()]
    for name in cases:
        if name not in CASES:
            values.refuse("--cases", name, f"is not one of {', '.join(CASES)}")
    if args.json:
        check_output(args.json, suffixes=(".json",), what="benchmark result")

    results = []
    for name in cases:
        result = run_case(name, args, max_bytes)
        results.append(result)
        print(f"{name:14} exit {result['exit_status']}  {result['seconds']:7.1f} s (deadline {result['deadline_s']:g} s)"
              f"  peak {result['peak_resident_mib']:5d} MiB  stderr {result['stderr_bytes']:4d} B in "
              f"{result['stderr_lines']} line(s)  {'; '.join(result['problems']) or 'ok'}", flush=True)
        print(f"{'':14} {result['message']}", flush=True)
    if args.json:
        write_atomically(args.json, json.dumps({"cases": results}, indent=1))
    return 1 if any(result["problems"] for result in results) else 0


if __name__ == "__main__":
    from script import run

    run(main)
