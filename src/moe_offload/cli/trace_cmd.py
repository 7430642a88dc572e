"""`moe-offload trace`: inspect, import, generate, flatten and seal routing traces."""

from __future__ import annotations

import json

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.outputs import check_output
from moe_offload.values import parse_bytes
from moe_offload.trace.flatten import flatten, write_csv, write_oracle_general
from moe_offload.trace.format import DECODE, EMBEDDING_KINDS, PREFILL, Trace, read_trace, seal_trace, write_trace
from moe_offload.trace.importers import (IMPORTERS, TAKES_ARRAY_LIMIT, TAKES_MODEL_CONFIG, TAKES_PROMPT_CACHE,
                                        TAKES_REQUEST_ROWS, TELLS_EACH_FILE)
from moe_offload.trace.importers.engine_trace import prompt_tokens_text
from moe_offload.trace.importers.engines import CAPTURE_ENGINES
from moe_offload.trace.synthetic import cyclic_trace, fixed_partition_trace, zipf_trace
from moe_offload.values import format_bytes

OPTIONAL_COLUMNS = ("weights", "probs", "embedding", "gate_prediction", "next_token_gate_prediction")
FLATTEN_WRITERS = {"csv": write_csv, "oracle-general": write_oracle_general}

# next_token_reuse compares consecutive tokens this many rows at a time, to bound its memory.
_REUSE_CHUNK_ROWS = 1 << 16


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "trace", help="inspect, import, generate and flatten routing traces",
        description="Routing traces: one Parquet file per trace, one row per token (see docs/trace-format.md).")
    actions = parser.add_subparsers(dest="trace_command", required=True, metavar="ACTION")

    info = actions.add_parser("info", help="summarise a trace file",
                              description="Print a trace's model, shape, counts, columns, provenance and a short "
                                          "routing summary.")
    info.add_argument("file", metavar="FILE", help="trace file (.parquet), or 'olmoe' / 'tiny' for a bundled one")
    info.add_argument("--json", action="store_true", help="print the summary as JSON")
    info.set_defaults(run=run_info)

    importer = actions.add_parser(
        "import", help="convert a public trace format into a trace file",
        description="Convert traces recorded by other projects, the routing vLLM and SGLang return with their "
                    "responses (see docs/guides/your-traffic.md), llama.cpp's llama-moe-trace and Megatron's "
                    "RouterTracer logs, or the generic request,token,layer,expert CSV (docs/traces.md lists every "
                    "source and what it can answer).")
    importer.add_argument("format", choices=sorted(IMPORTERS), metavar="FORMAT",
                          help=f"source format: {', '.join(sorted(IMPORTERS))}")
    importer.add_argument("sources", nargs="+", metavar="SRC", help="source file(s)")
    importer.add_argument("-o", "--output", required=True, metavar="FILE", help="trace file to write")
    importer.add_argument("--experts", type=int, metavar="J",
                          help="experts per layer (required for every format but routes-json and sglang unless "
                               "--model-config gives it: their files do not say it)")
    importer.add_argument("--model-config", metavar="CONFIG",
                          help="the model's Hugging Face config.json, for L, J, K and the expert size (every format "
                               f"but {', '.join(sorted(set(IMPORTERS) - set(TAKES_MODEL_CONFIG)))}; required for "
                               "sglang and llama-moe-trace's layer,expert rows)")
    importer.add_argument("--model", metavar="NAME", help="model name to record")
    importer.add_argument("--expert-bytes", type=int, metavar="N", help="bytes of one expert's weights")
    importer.add_argument("--hidden-size", type=int, metavar="D", help="the model's hidden size")
    importer.add_argument("--source", metavar="TEXT", help="provenance to record (default: the file names)")
    importer.add_argument("--license", metavar="TEXT", help="license of the source data")
    importer.add_argument("--keep-cached-prompt", action="store_true",
                          help="vllm, sglang: keep the prompt tokens served from the prefix cache (the first "
                               "usage.prompt_tokens_details.cached_tokens) where their ids are present; by default "
                               "they are dropped and counted, as they ran no experts in their request")
    importer.add_argument("--request-rows", type=int, metavar="N",
                          help="topk-jsonl: each file is requests of N lines, one after the other (the file does "
                               "not say where a request ends; by default a file is one request)")
    importer.add_argument("--prompt-rows", type=int, default=0, metavar="P",
                          help="topk-jsonl: the first P lines of each request are its prompt, one prefill pass "
                               "(default 0: every line a decode token)")
    importer.add_argument("--max-array-bytes", default="2GiB", metavar="BYTES",
                          help="the largest routing array an import decodes (vllm, sglang, npy; default 2GiB): a "
                               "declared size past it is refused before anything is allocated")
    importer.set_defaults(run=run_import)

    capture = actions.add_parser(
        "capture", help="send prompts to a server that returns routed experts and write their trace",
        description="Send each prompt as a /v1/completions request (at most --concurrency at once) to an "
                    "OpenAI-compatible server that returns the routing with its answers: moe-offload serve, "
                    "SGLang or vLLM started with --enable-return-routed-experts. Arrival times are recorded; "
                    "the trace is written when every answer is in (see docs/guides/your-traffic.md).")
    capture.add_argument("--url", required=True, metavar="URL", help="the server, e.g. http://127.0.0.1:8000")
    capture.add_argument("--prompts", required=True, metavar="SOURCES",
                         help="comma-separated prompt sources: sharegpt, humaneval, or files with one prompt per "
                              "line (or .jsonl with 'prompt')")
    capture.add_argument("--limit", type=int, metavar="N", help="at most N prompts from each source")
    capture.add_argument("--engine", choices=CAPTURE_ENGINES, default="moe-offload",
                         help="how the server returns routing: moe-offload and sglang (sgl_ext.routed_experts, "
                              "asked per request), vllm (prompt_routed_experts and routed_experts); default "
                              "moe-offload")
    capture.add_argument("--concurrency", type=int, default=8, metavar="N", help="requests in flight (default 8)")
    capture.add_argument("--max-tokens", type=int, default=32, metavar="N", help="tokens per answer (default 32)")
    capture.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0, greedy)")
    capture.add_argument("--model", metavar="NAME", help="the model to ask for (default: the first the server lists)")
    capture.add_argument("--model-config", metavar="CONFIG",
                         help="the model's config.json for L, J, K and the expert size ('tiny': the bundled "
                              "model's); required for moe-offload and sglang")
    capture.add_argument("--experts", type=int, metavar="J", help="experts per layer, when no --model-config")
    capture.add_argument("--expert-bytes", type=int, metavar="N", help="bytes of one expert's weights")
    capture.add_argument("--connect-timeout", default="10", metavar="SECONDS",
                         help="seconds to connect to the server (default 10)")
    capture.add_argument("--timeout", default="600", metavar="SECONDS",
                         help="seconds for one request from sending to the end of its answer, the server's "
                              "generation included (default 600)")
    capture.add_argument("--read-timeout", default="60", metavar="SECONDS",
                         help="seconds from an answer's first byte to its last (default 60): a server that stalls "
                              "or drips is cut then")
    capture.add_argument("--max-response", default="256MiB", metavar="BYTES",
                         help="largest answer accepted (default 256MiB)")
    capture.add_argument("-o", "--output", required=True, metavar="TRACE", help="trace file to write (.parquet)")
    capture.set_defaults(run=run_capture)

    synth = actions.add_parser("synth", help="generate a synthetic trace",
                               description="Generate the synthetic traces of the layered-paging paper (001).")
    generators = synth.add_subparsers(dest="generator", required=True, metavar="GENERATOR")

    zipf = generators.add_parser("zipf", help="i.i.d. tokens, Zipf expert popularity 1/(j+b)^a per layer",
                                 description="Each token draws top-k distinct experts per layer without replacement, "
                                             "expert j (j = 1..J) with weight 1/(j+b)^a (paper 001, section 5.1).")
    zipf.add_argument("--layers", type=int, default=32, help="L (default 32)")
    zipf.add_argument("--experts", type=int, default=8, help="J, experts per layer (default 8)")
    zipf.add_argument("--top-k", type=int, default=2, help="K (default 2)")
    zipf.add_argument("--length", type=int, default=10_000, help="tokens (default 10000)")
    zipf.add_argument("--a", type=float, default=1.0, help="Zipf exponent a >= 0 (default 1.0; 0 = uniform)")
    zipf.add_argument("--b", type=float, default=0.0, help="Zipf offset b > -1 (default 0)")
    zipf.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    zipf.add_argument("--shuffle", action="store_true",
                      help="give each layer its own random order of expert popularity")
    zipf.set_defaults(run=run_synth_zipf)

    cyclic = generators.add_parser("cyclic", help="Theorem 3.3: all k+1 experts cyclically (LRU's worst case)",
                                   description="n = (k+1)/L experts per layer; round i requests expert i mod n of "
                                               "every layer (paper 001, Theorem 3.3). L must divide k+1.")
    cyclic.add_argument("--layers", type=int, required=True, help="L")
    cyclic.add_argument("--cache-size", type=int, required=True, help="k, the cache size the sequence defeats")
    cyclic.add_argument("--rounds", type=int, default=1000, help="rounds (tokens, default 1000)")
    cyclic.set_defaults(run=run_synth_cyclic)

    fixed = generators.add_parser("fixed-partition",
                                  help="Theorem 3.1: one layer cycles, the others repeat expert 0",
                                  description="Round i requests expert 0 of every layer except the cycling layer, "
                                              "which requests expert i mod n (paper 001, Theorem 3.1).")
    fixed.add_argument("--layers", type=int, required=True, help="L")
    fixed.add_argument("--experts", type=int, required=True, help="n, experts per layer")
    fixed.add_argument("--rounds", type=int, default=1000, help="rounds (tokens, default 1000)")
    fixed.add_argument("--cycling-layer", type=int, default=0, help="the layer that cycles (default 0)")
    fixed.set_defaults(run=run_synth_fixed_partition)

    for generator in (zipf, cyclic, fixed):
        generator.add_argument("-o", "--output", required=True, metavar="FILE", help="trace file to write")

    flat = actions.add_parser(
        "flatten", help="export the expert request sequence for other cache simulators",
        description="Write one record per expert request in replay order: for each token, for each rank r, for "
                    "each layer l, id = l*J + expert; size = expert bytes (1 when unknown).")
    flat.add_argument("file", metavar="FILE", help="trace file (.parquet), or a bundled trace's name")
    flat.add_argument("-o", "--output", required=True, metavar="OUT", help="file to write")
    flat.add_argument("--format", choices=sorted(FLATTEN_WRITERS), default="csv",
                      help="csv: time,id,size rows (default); oracle-general: libCacheSim's binary oracleGeneral "
                           "trace, which also carries each request's next access time")
    flat.set_defaults(run=run_flatten)

    seal = actions.add_parser(
        "seal", help="check trace files and rewrite them sealed with their checksum (trace format 2)",
        description="Read each FILE, check it as every command does (a sealed file must match its checksum), "
                    "and write it back in place, atomically, with the checksum of its content that every "
                    "read verifies: for traces written before moe-offload sealed its traces (format 1), and "
                    "for the bundled traces (`moe-offload trace seal src/moe_offload/data/*.parquet`).")
    seal.add_argument("files", nargs="+", metavar="FILE", help="trace files to seal in place")
    seal.set_defaults(run=run_seal)


# --------------------------------------------------------------------------------------------------- info

def run_info(args) -> int:
    from moe_offload.bundled import trace_path

    path = trace_path(args.file)
    trace = read_trace(path)
    summary = describe(trace, path.stat().st_size)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
    return 0


def describe(trace: Trace, file_bytes: int | None = None) -> dict:
    """Everything `trace info` reports, as plain JSON-able values."""
    meta = trace.meta
    usage = expert_usage(trace)
    top_share = usage.max(axis=1) / trace.num_tokens  # each token selects a layer's expert at most once
    return {
        "file": trace.path,
        "file_bytes": file_bytes,
        "model": meta.model,
        "num_layers": meta.num_layers,
        "num_experts": meta.num_experts,
        "top_k": meta.top_k,
        "expert_bytes": meta.expert_bytes,
        "hidden_size": meta.hidden_size,
        "tokens": trace.num_tokens,
        "requests": trace.num_requests,
        "iterations": int(np.unique(trace.iteration).size),
        "prefill_tokens": int(np.count_nonzero(trace.phase == PREFILL)),
        "decode_tokens": int(np.count_nonzero(trace.phase == DECODE)),
        "columns": {name: getattr(trace, name) is not None for name in OPTIONAL_COLUMNS},
        "embedding_kind": meta.embedding_kind if trace.embedding is not None else None,
        "source": meta.source,
        "license": meta.license,
        "extra": meta.extra,
        "routing": {
            "top_expert_token_share": [round(float(s), 4) for s in top_share],
            "experts_used": int(np.count_nonzero(usage)),
            "next_token_reuse": _rounded(next_token_reuse(trace)),
            "uniform_baseline": round(meta.top_k / meta.num_experts, 4),
        },
    }


def expert_usage(trace: Trace) -> np.ndarray:
    """[L, J] how many tokens selected each expert."""
    L, J = trace.meta.num_layers, trace.meta.num_experts
    flat = (np.arange(L, dtype=np.int64)[None, :, None] * J + trace.experts).reshape(-1)
    return np.bincount(flat, minlength=L * J).reshape(L, J)


def next_token_reuse(trace: Trace) -> float | None:
    """Mean share of a token's experts that the next token of the same request selects again in the same
    layer (uniform independent routing gives K/J). None when no request has two tokens."""
    experts, same_request = trace.experts, trace.request[1:] == trace.request[:-1]
    total_shared, pairs = 0, 0
    for start in range(0, trace.num_tokens - 1, _REUSE_CHUNK_ROWS):
        stop = min(start + _REUSE_CHUNK_ROWS, trace.num_tokens - 1)
        keep = same_request[start:stop]
        current, following = experts[start:stop][keep], experts[start + 1:stop + 1][keep]
        # shared[t, l] = |experts of token t in layer l  &  experts of token t+1 in layer l|
        shared = (current[:, :, :, None] == following[:, :, None, :]).any(axis=3).sum(axis=2)
        total_shared += int(shared.sum())
        pairs += int(keep.sum())
    if pairs == 0:
        return None
    return total_shared / (pairs * trace.meta.num_layers * trace.meta.top_k)


def format_summary(summary: dict) -> str:
    routing = summary["routing"]
    L, J, K = summary["num_layers"], summary["num_experts"], summary["top_k"]
    expert_bytes = summary["expert_bytes"]
    share = np.asarray(routing["top_expert_token_share"])
    present = [name for name, there in summary["columns"].items() if there]
    absent = [name for name, there in summary["columns"].items() if not there]
    reuse = routing["next_token_reuse"]
    lines = [
        ("file", f"{summary['file']} ({format_bytes(summary['file_bytes'])})"),
        ("model", summary["model"]),
        ("shape", f"{L} layers x {J} experts = {L * J} experts, top-{K}"),
        ("expert bytes", "unknown" if expert_bytes is None else
         f"{expert_bytes:,} ({format_bytes(expert_bytes)}; all experts {format_bytes(expert_bytes * L * J)})"),
        ("hidden size", "unknown" if summary["hidden_size"] is None else str(summary["hidden_size"])),
        ("tokens", f"{summary['tokens']} (prefill {summary['prefill_tokens']}, decode {summary['decode_tokens']})"),
        *([("prompt tokens", prompt_tokens_text(summary["extra"]))] if prompt_tokens_text(summary["extra"]) else []),
        ("requests", str(summary["requests"])),
        ("iterations", str(summary["iterations"])),
        ("columns", ", ".join(["experts", *present]) + (f" (absent: {', '.join(absent)})" if absent else "")),
        *([("embedding", EMBEDDING_KINDS[summary["embedding_kind"]])] if summary["embedding_kind"] else []),
        ("expert order", "sorted by id: the router's rank order is lost" if summary["extra"].get("experts_sorted")
         else "as recorded (the router's rank order where the source knew it)"),
        ("source", summary["source"] or "unknown"),
        ("license", summary["license"] or "not stated"),
        ("top expert", f"the most used expert of a layer serves {share.mean():.1%} of tokens on average "
                       f"(min {share.min():.1%}, max {share.max():.1%}; uniform routing: {K / J:.1%})"),
        ("reuse", "no consecutive tokens" if reuse is None else
         f"the next token reselects {reuse:.1%} of a token's experts (uniform routing: {K / J:.1%})"),
        ("experts used", f"{routing['experts_used']} of {L * J}"),
    ]
    width = max(len(label) for label, _ in lines)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in lines)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


# ------------------------------------------------------------------------------------------ import, synth

def run_import(args) -> int:
    check_output(args.output, inputs=[*args.sources, args.model_config], what="trace")
    options = {}
    if args.format in TAKES_ARRAY_LIMIT:
        options["max_array_bytes"] = parse_bytes(args.max_array_bytes, "--max-array-bytes")
    if args.keep_cached_prompt:
        if args.format not in TAKES_PROMPT_CACHE:
            raise ConfigError(f"--keep-cached-prompt is for the formats {', '.join(TAKES_PROMPT_CACHE)}, not "
                              f"{args.format}")
        options["keep_cached_prompt"] = True
    for option, given in (("--request-rows", args.request_rows is not None), ("--prompt-rows", args.prompt_rows)):
        if given and args.format not in TAKES_REQUEST_ROWS:
            raise ConfigError(f"{option} is for the formats {', '.join(TAKES_REQUEST_ROWS)}, not {args.format}")
    if args.format in TAKES_REQUEST_ROWS:
        options.update(request_rows=args.request_rows, prompt_rows=args.prompt_rows)
    if args.model_config is not None:
        if args.format not in TAKES_MODEL_CONFIG:
            raise ConfigError(f"--model-config is for the formats {', '.join(TAKES_MODEL_CONFIG)}, not {args.format}")
        options["model_config"] = _model_config(args.model_config)
    from moe_offload.reporting.progress import progress_bar

    with progress_bar() as bar:  # on stderr, on a terminal only (reporting/progress.py)
        if args.format in TELLS_EACH_FILE:
            task = bar.add_task(f"reading {len(args.sources)} files", total=len(args.sources))
            options["on_file"] = lambda: bar.advance(task)
        trace = IMPORTERS[args.format](args.sources, num_experts=args.experts, model=args.model,
                                       expert_bytes=args.expert_bytes, hidden_size=args.hidden_size,
                                       source=args.source, license=args.license, **options)
    return _write(trace, args.output)


def run_capture(args) -> int:
    from moe_offload.reporting.progress import progress_bar
    from moe_offload.text.prompts import BUILTIN_SOURCES, load_prompts
    from moe_offload import values
    from moe_offload.trace.bounded_http import Limits
    from moe_offload.trace.capture import capture, server_url

    server_url(args.url)  # a bad address is refused before the prompts load
    limits = Limits(**{field: values.number(getattr(args, option), f"--{option.replace('_', '-')}", low=0,
                                            low_open=True)
                       for field, option in (("connect_seconds", "connect_timeout"), ("total_seconds", "timeout"),
                                             ("read_seconds", "read_timeout"))},
                    max_bytes=values.parse_bytes(args.max_response, "--max-response"))
    prompt_files = [name.strip() for name in args.prompts.split(",") if name.strip() not in BUILTIN_SOURCES]
    check_output(args.output, inputs=[*prompt_files, args.model_config], what="trace")
    shape = _model_config(args.model_config)
    prompts = load_prompts(args.prompts, args.limit)
    with progress_bar() as bar:  # capture checks the options, then asks the server for its model, then sends
        task = bar.add_task(f"capturing {len(prompts)} prompts", total=len(prompts))
        trace = capture(args.url, prompts, engine=args.engine, model=args.model, max_tokens=args.max_tokens,
                        temperature=args.temperature, concurrency=args.concurrency, model_config=shape,
                        num_experts=args.experts, expert_bytes=args.expert_bytes, limits=limits,
                        on_answer=lambda: bar.advance(task))
    return _write(trace, args.output)


def _model_config(name: str | None):
    """--model-config: a config.json, or 'tiny' for the bundled model's."""
    from moe_offload.bundled import TINY_MODEL_DIR
    from moe_offload.inputs import missing
    from moe_offload.trace.importers.model_config import read_model_config

    if name is None:
        return None
    if name == "tiny" and missing(name):
        return read_model_config(TINY_MODEL_DIR / "config.json")
    return read_model_config(name)


def run_synth_zipf(args) -> int:
    check_output(args.output, what="trace")
    trace = zipf_trace(args.layers, args.experts, args.top_k, args.length, args.a, args.b, args.seed,
                       shuffle=args.shuffle)
    return _write(trace, args.output)


def run_synth_cyclic(args) -> int:
    check_output(args.output, what="trace")
    return _write(cyclic_trace(args.layers, args.cache_size, args.rounds), args.output)


def run_synth_fixed_partition(args) -> int:
    check_output(args.output, what="trace")
    return _write(fixed_partition_trace(args.layers, args.experts, args.rounds, args.cycling_layer), args.output)


def _write(trace: Trace, output: str) -> int:
    path = write_trace(trace, output)
    meta = trace.meta
    print(f"wrote {path}: {trace.num_tokens} tokens in {trace.num_requests} request(s), {meta.num_layers} layers "
          f"x {meta.num_experts} experts, top-{meta.top_k} ({format_bytes(path.stat().st_size)})")
    return 0


# -------------------------------------------------------------------------------------------------- flatten

def run_flatten(args) -> int:
    from moe_offload.bundled import trace_path

    check_output(args.output, inputs=[trace_path(args.file)], what="request sequence")
    trace = read_trace(args.file)
    sequence = flatten(trace)
    path = FLATTEN_WRITERS[args.format](sequence, args.output, trace.meta.expert_bytes)
    print(f"wrote {path}: {len(sequence)} expert requests ({args.format})")
    return 0


# ----------------------------------------------------------------------------------------------------- seal

def run_seal(args) -> int:
    from moe_offload.bundled import trace_path

    for name in args.files:  # rewritten in place: the folder must be writable
        check_output(trace_path(name), what="sealed trace")
    for name in args.files:
        was_sealed = seal_trace(name)
        trace_file = read_trace(name, columns=())
        print(f"{'re-sealed' if was_sealed else 'sealed'} {trace_file.path}: {trace_file.num_tokens} tokens, "
              "checksum verified on reading it back")
    return 0
