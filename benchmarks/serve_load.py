"""Load on the OpenAI-compatible server: concurrent clients against the same requests sent one at a time.

    python benchmarks/serve_load.py [--clients 1,4,16,64] [--budgets 30,100] [--requests 64]
        [--max-tokens 16] [--policy lru] [--prefetch none] [--max-batch 64] [--batch-math exact,fast]
        [--repeat 1] [--threads N] [--json FILE]

For each fast budget a fresh engine (cold fast tier) serves in this process on a free port
(``ServerThread``); the same ``--requests`` ShareGPT first turns (chat, greedy) are sent by 1, 4, 16 and 64
concurrent clients through the official ``openai`` client, streaming, each client taking the next request
when its last one ended. The clients run in a process of their own, as a server's clients do: as threads of
the server's process they would take its interpreter lock between the scheduler's operations (measured
at 16 clients and 100%, two runs each way: fast batch math 395-397 tok/s with the clients as threads here
against 473-480 from their own process; exact 302-309 against 295-359). 1 client is the requests sent one
at a time. Per level: output tokens/s (all output tokens / wall time), TTFT and TPOT p50 and p99 as the
clients see them (first streamed text; the gaps after it per output token), the fast tier's hit rate over the
level, errors (must be 0), and the ratio of tokens/s to one at a time. With ``batch_math`` exact (the default)
every level checks that each request's text equals its text at one client (greedy outputs do not depend on the
batch); with fast (every matrix product over the whole batch) the texts that differ are counted, not failed.

Where the time goes, per level: the scheduler thread's forward passes (``forward``; of it, the passes
that carry at least one prompt: ``prompts``, and the time spent waiting for experts: ``stall``), its
sampling, detokenising and stop checks (``advance``), and the rest of the wall time, in which the
scheduler thread is idle: HTTP, JSON, request parsing and tokenising in the event loop, and the clients'
process, which shares this machine's cores (``other``).

This machine has 2 cores shared with other work, whose load changes the speed of a run by up to 2x from
one minute to the next: with ``--repeat N`` the levels run N times in turn (1, 4, 16, 64, 1, 4, ...) on
the same engine and each level reports its fastest round (its errors and text checks: all rounds), so a
slow minute does not land on one level only. Ratios within one run are the numbers to read.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor


def sharegpt_first_turns(count: int) -> list[str]:
    from moe_offload.text.prompts import MAX_SHAREGPT_CHARS
    from moe_offload.text.sources import sharegpt_prompts

    return [text[:MAX_SHAREGPT_CHARS // 4] for text in sharegpt_prompts()[200:200 + count]]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def one_request(client, question: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    times, text, usage, finish = [], [], None, None
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            if chunk.choices[0].delta.content:
                times.append(time.perf_counter())
                text.append(chunk.choices[0].delta.content)
            finish = chunk.choices[0].finish_reason or finish
    tokens = usage.completion_tokens if usage is not None else 0
    return {"text": "".join(text), "tokens": tokens, "finish": finish,
            "ttft": times[0] - started if times else None,
            "tpot": (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else None}


def drive_clients(url: str, questions: list[str], clients: int, max_tokens: int) -> tuple[list, list, float]:
    """The clients' side of a level, run in the clients' process: each of ``clients`` threads sends the next
    question when its last one ended. (results, errors, wall seconds)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    errors = []

    def worker(question):
        try:
            return one_request(client, question, max_tokens)
        except Exception as exc:  # noqa: BLE001 - counted, the benchmark reports errors
            errors.append(f"{type(exc).__name__}: {exc}")
            return None

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(worker, questions))
    return results, errors, time.perf_counter() - started


def run_level(server, engine, clients_process, questions: list[str], clients: int, max_tokens: int) -> dict:
    scheduler = engine.scheduler
    before, forward, advance = engine.stats, scheduler.forward_seconds, scheduler.advance_seconds
    prompts = scheduler.prompt_pass_seconds
    results, errors, wall = clients_process.submit(drive_clients, server.url, questions, clients, max_tokens).result()
    after = engine.stats
    done = [r for r in results if r is not None]
    tokens = sum(r["tokens"] for r in done)
    accesses, hits = after.accesses - before.accesses, after.hits - before.hits
    forward = scheduler.forward_seconds - forward
    advance = scheduler.advance_seconds - advance
    prompts = scheduler.prompt_pass_seconds - prompts
    stall = after.stall_seconds - before.stall_seconds
    ttfts = [r["ttft"] for r in done if r["ttft"] is not None]
    tpots = [r["tpot"] for r in done if r["tpot"] is not None]
    errors += [f"finish_reason {r['finish']}" for r in done if r["finish"] not in ("length", "stop")]
    return {"clients": clients, "requests": len(questions), "output_tokens": tokens, "wall_seconds": wall,
            "tokens_per_second": tokens / wall, "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
            "tpot_p50": percentile(tpots, 50), "tpot_p99": percentile(tpots, 99),
            "hit_rate": hits / accesses if accesses else 0.0, "expert_accesses": accesses, "errors": errors,
            "forward_seconds": forward, "prompt_pass_seconds": prompts, "stall_seconds": stall,
            "advance_seconds": advance,
            "other_seconds": max(wall - forward - advance, 0.0), "texts": [r["text"] if r else None for r in results]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--budgets", default="30,100", help="fast budgets, percent of all expert bytes")
    parser.add_argument("--requests", default="64", help="requests per level (default 64)")
    parser.add_argument("--max-tokens", default="16")
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--prefetch", default="none")
    parser.add_argument("--max-batch", default="64")
    parser.add_argument("--batch-math", default="exact,fast")
    parser.add_argument("--repeat", default="1", help="rounds of all levels per engine; each level keeps its best")
    parser.add_argument("--threads", default=None, help="PyTorch's CPU threads (default: PyTorch's, one per core)")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)

    from moe_offload import values
    from moe_offload.api import load
    from moe_offload.outputs import check_output, write_atomically
    from moe_offload.server import ServerThread

    clients = [values.integer(c, "--clients", low=1) for c in args.clients.split(",")]
    budgets = [values.number(b, "--budgets", low=0, high=100, low_open=True) for b in args.budgets.split(",")]
    requests = values.integer(args.requests, "--requests", low=1)
    max_tokens = values.integer(args.max_tokens, "--max-tokens", low=1)
    max_batch = values.integer(args.max_batch, "--max-batch", low=1)
    repeat = values.integer(args.repeat, "--repeat", low=1)
    if args.threads is not None:
        import torch

        torch.set_num_threads(values.integer(args.threads, "--threads", low=1, high=values.cores()))
    if args.json:
        check_output(args.json, suffixes=(".json",), what="benchmark result")
    if 1 not in clients:
        clients = [1] + clients  # the baseline: one at a time
    questions = sharegpt_first_turns(requests)
    prefetch = None if args.prefetch == "none" else args.prefetch
    rows = []
    import torch

    print(f"{len(questions)} ShareGPT first turns, {max_tokens} new tokens each, greedy, streaming; policy "
          f"{args.policy}, prefetch {args.prefetch}, max batch {max_batch}, {torch.get_num_threads()} PyTorch "
          f"thread(s), best of {repeat} round(s); shared 2-core machine: read ratios")
    maths = args.batch_math.split(",")
    for math in maths:
        if math not in ("exact", "fast"):
            values.refuse("--batch-math", math, "must be exact or fast")
    header = (f"{'math':>5} {'budget':>6} {'clients':>7} {'tok/s':>7} {'x 1':>5} {'TTFT p50':>9} {'p99':>7} "
              f"{'TPOT p50':>9} {'p99':>7} {'hit':>6} {'err':>4} | {'wall':>6} {'forward':>7} {'prompts':>7} "
              f"{'stall':>6} {'advance':>7} {'other':>6}")
    print(header)
    for budget, math in [(b, m) for b in budgets for m in maths]:
        with load("tiny", fast_budget=f"{budget:g}%", policy=args.policy, prefetch=prefetch, max_batch=max_batch,
                  batch_math=math) as engine, ServerThread(engine, "tiny") as server, \
                ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients_process:
            rounds = {level: [] for level in clients}
            for _ in range(repeat):
                for level in clients:
                    row = run_level(server, engine, clients_process, questions, level, max_tokens)
                    baseline = rounds[1][0]["texts"] if rounds[1] else row["texts"]  # round 1's one at a time
                    row["texts_differing_from_one_at_a_time"] = sum(a != b for a, b in zip(row["texts"], baseline))
                    if row["texts_differing_from_one_at_a_time"] and math == "exact":
                        row["errors"].append("a text differs from the one-at-a-time run")
                    rounds[level].append(row)
            best = {}
            for level, runs in rounds.items():  # each level's fastest round; errors and differing texts: all rounds
                best[level] = dict(max(runs, key=lambda r: r["tokens_per_second"]),
                                   errors=[e for r in runs for e in r["errors"]],
                                   texts_differing_from_one_at_a_time=sum(
                                       r["texts_differing_from_one_at_a_time"] for r in runs))
            for level in clients:
                row = best[level]
                row["budget_percent"], row["batch_math"], row["rounds"] = budget, math, repeat
                row["threads"] = torch.get_num_threads()
                row["speedup"] = row["tokens_per_second"] / best[1]["tokens_per_second"]
                rows.append(row)
                ms = lambda v: f"{v * 1000:7.0f}" if v is not None else "      -"  # noqa: E731
                print(f"{math:>5} {budget:5g}% {level:7d} {row['tokens_per_second']:7.1f} {row['speedup']:5.2f} "
                      f"{ms(row['ttft_p50'])}ms {ms(row['ttft_p99'])} {ms(row['tpot_p50'])}ms {ms(row['tpot_p99'])} "
                      f"{row['hit_rate']:6.1%} {len(row['errors']):4d} | {row['wall_seconds']:6.1f} "
                      f"{row['forward_seconds']:7.1f} {row['prompt_pass_seconds']:7.1f} {row['stall_seconds']:6.1f} "
                      f"{row['advance_seconds']:7.1f} "
                      f"{row['other_seconds']:6.1f}", flush=True)
    failures = [e for row in rows for e in row["errors"]]
    for row in rows:
        row.pop("texts")
    if args.json:
        write_atomically(args.json, json.dumps(rows, indent=1))
    if failures:
        print(f"{len(failures)} error(s), first: {failures[0]}", file=sys.stderr)
        return 1
    sixteen = [r for r in rows if r["clients"] == 16]
    if sixteen:
        print("tokens/s at 16 clients / one at a time: " + ", ".join(
            f"{r['speedup']:.2f}x at {r['budget_percent']:g}% ({r['batch_math']})" for r in sixteen))
    differing = [f"{r['texts_differing_from_one_at_a_time']} at {r['clients']} clients, {r['budget_percent']:g}%"
                 for r in rows if r["batch_math"] == "fast" and r["clients"] > 1]  # over all rounds
    if differing:
        print("fast batch math, texts differing from one at a time: " + ", ".join(differing))
    return 0


if __name__ == "__main__":
    from script import run

    run(main)
