"""`moe-offload report`: its numbers are `simulate`'s, its page is well-formed and self-contained, its commands
parse, its latency is the timed simulator's, and bad input is refused in one line before any work."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import shutil
import subprocess
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from moe_offload.cli.main import build_parser, main
from moe_offload.errors import ConfigError
from moe_offload.hardware import resolve_profile
from moe_offload.reporting.latency import measure_latency
from moe_offload.reporting.recommend import command_lines, commands
from moe_offload.simulator.timed import simulate_timed
from moe_offload.simulator.timed.schedule import leading_iterations


def run_cli(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's errors
            code = exc.code
    return code, out.getvalue(), err.getvalue()


QUICKSTART = Path(__file__).resolve().parents[1] / "scripts" / "quickstart.sh"


@pytest.fixture(scope="module")
def olmoe_report(tmp_path_factory):
    """The quickstart's report (scripts/quickstart.sh: one engine's settings, the replay in Python), its timed
    runs cut to 16 tokens (the tests below check no engine's section: test_engines.py does, and the README's
    `report tiny` (test_docs.py) runs every engine's)."""
    page = tmp_path_factory.mktemp("report") / "olmoe.html"
    command = " ".join(QUICKSTART.read_text().split("\\\n")).split(".venv/bin/moe-offload report ")[1].split("\n")[0]
    argv = ["report", *shlex.split(command)]
    assert argv[argv.index("-o") + 1] == "out/report.html"
    argv[argv.index("-o") + 1] = str(page)
    argv[argv.index("--timed-tokens") + 1] = "16"
    code, out, err = run_cli([*argv, "--jobs", "1"])
    assert code == 0, err
    return out, page.read_text(encoding="utf-8")


def test_the_verdict_and_the_table_are_simulates_numbers(olmoe_report):
    out, _ = olmoe_report
    code, simulated, err = run_cli(["simulate", "olmoe", "--cache-size", "25%", "--json", "--jobs", "1"])
    assert code == 0, err
    results = {r["policy"]: r for r in json.loads(simulated)}
    opt = results["belady"]
    best = min((r for name, r in results.items() if name not in ("belady", "belady-dist")),
               key=lambda r: (-r["hits"], r["policy"]))  # ties: the first name, as the report orders them
    text = " ".join(out.split())
    assert (f"verdict: {best['policy']} reaches {best['hits'] / opt['hits']:.0%} of the hits Belady reaches at "
            f"{opt['cache_size']} experts (25.0% of 1,024): the policy leaves "
            f"{(opt['hits'] - best['hits']) / opt['accesses']:.1%} of the requests ({opt['hits'] - best['hits']:,} "
            f"hits of {opt['accesses']:,}) on the table") in text
    for name, result in results.items():
        if name != "belady-dist":
            label = "belady (OPT)" if name == "belady" else name
            row = out.split(f"│ {label} ")[1].split("\n")[0]
            assert f"{result['hit_rate']:.2%}" in row


class StrictPage(HTMLParser):
    """Every element closed in order (void elements excepted); what the page would fetch."""

    VOID = {"meta", "br", "hr", "img", "input", "link"}

    def __init__(self):
        super().__init__()
        self.open, self.errors, self.fetches = [], [], []

    def handle_starttag(self, tag, attrs):
        self.fetches += [(tag, name, value) for name, value in attrs
                         if name in ("src", "href", "xlink:href") and not (value or "").startswith("#")]
        if tag in ("script", "link", "iframe", "img"):
            self.fetches.append((tag, "", ""))
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.fetches += [(tag, name, value) for name, value in attrs
                         if name in ("src", "href", "xlink:href") and not (value or "").startswith("#")]

    def handle_endtag(self, tag):
        if not self.open or self.open[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.open[-1:]}")
        else:
            self.open.pop()


def test_the_page_is_well_formed_and_self_contained(olmoe_report):
    _, page = olmoe_report
    parser = StrictPage()
    parser.feed(page)
    parser.close()
    assert parser.errors == [] and parser.open == []
    assert parser.fetches == []
    assert page.count("<svg") == 5  # working set, reuse, skew, policies, latency
    # the figures' labels are text the browser draws, not glyph outlines
    for label in ("window (tokens)", "cache size (experts)", "Belady (OPT)", "hit rate at 256 experts"):
        assert f">{label}</text>" in page, label
    assert "<h2>What to run</h2>" in page and "--fast-budget 256" in page
    # what the quickstart's report leaves out, it says, with the flag that puts it back
    assert "engine settings scored for vllm only: --engine all scores llama.cpp, ktransformers, sglang too" in page
    # what each engine setting is, under its table
    assert ("<li>--moe-expert-cache-size 16 (PR #37190): vllm-project/vllm PR #37190 (open, not merged): LFRU cache "
            "of 16 experts per layer, misses copied on demand</li>") in page
    assert "the first 16 iterations of 299" in " ".join(page.split())


def test_the_page_opens_in_a_headless_browser(olmoe_report, tmp_path):
    """Chromium renders the page (``.ci/run`` installs Debian's ``chromium`` when it runs as root): the DOM it
    builds holds the report's text and its five figures, and its screenshot is a page of that size, not blank."""
    browser = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                    if shutil.which(name)), None)
    if browser is None:
        pytest.skip("no headless browser installed (.ci/run installs Debian's chromium when run as root)")
    _, html = olmoe_report
    page = tmp_path / "page.html"
    page.write_text(html, encoding="utf-8")
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=300)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "policy or working set?" in dom.stdout and dom.stdout.count("<svg") == 5
    assert "of the hits Belady reaches at 256 experts" in dom.stdout and "What to run" in dom.stdout
    shot = tmp_path / "page.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1200,3000", page.as_uri()],
                   capture_output=True, timeout=300)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (1200, 3000)
    assert len(png) > 50_000  # text, tables and figures: a blank page of this size compresses to a few kB


def test_the_first_rows_are_read_against_lru_on_them_in_the_terminal_and_the_page(tmp_path, monkeypatch,
                                                                                   uncompiled_policy):
    from moe_offload.reporting import bound

    monkeypatch.setattr(bound, "PYTHON_REPLAY_REQUESTS", 5000)  # olmoe's 38,272 requests: 39 tokens
    page = tmp_path / "report.html"
    code, out, err = run_cli(["report", "olmoe", "--fast-memory", "25%", "--timed-tokens", "4", "--engine", "vllm",
                              "--jobs", "1", "-o", str(page)])
    assert code == 0, err
    said = " ".join(out.split())
    names = [line.split()[1] for line in out.splitlines() if line.endswith("first 39 tokens │")]  # "│ name │ ..."
    assert names[0] == "belady" and sorted(names[1:]) == ["lru", uncompiled_policy]  # OPT first, then by hits
    sentence = f"{uncompiled_policy} ran on the first 39 tokens only (`--exact`: the whole trace); there LRU hits"
    assert sentence in said and "on the whole trace: read them against LRU's and OPT's rows on the same tokens" in said
    assert sentence in " ".join(page.read_text(encoding="utf-8").split())


def test_latency_is_the_timed_simulators_and_the_commands_parse(tiny_trace):
    hardware = resolve_profile("desktop-rtx4090")
    meta = tiny_trace.meta
    latency = measure_latency(tiny_trace, hardware, 16, meta.expert_bytes, ["lecar", "lru"], tokens=64)
    sample = leading_iterations(tiny_trace, 64)
    assert latency.tokens == sample.num_tokens <= 64 and latency.sampled
    assert tiny_trace.iteration[sample.num_tokens] != sample.iteration[-1]  # whole iterations only
    reference = simulate_timed(sample, hardware, "lecar", 16 * meta.expert_bytes, prefetcher="topk")
    run = next(r for r in latency.runs if r.policy == "lecar" and r.prefetcher == "topk")
    assert (run.tpot_seconds, run.ttft_seconds, run.hits) == (reference.tpot_seconds, reference.ttft_seconds,
                                                              reference.hits)
    candidates = latency.candidates()
    assert latency.best() is candidates[0]
    assert [r.tpot_seconds for r in candidates] == sorted(r.tpot_seconds for r in candidates)
    assert latency.moepic is not None and latency.moepic_config["budget_experts"] == 16 - meta.top_k
    only_moepic = replace(latency, runs=[latency.all_resident])  # MoEpic is then the fastest
    for variant in (latency, replace(latency, moepic=None), only_moepic):
        best = variant.best()
        lines = command_lines(commands(meta, "tiny", hardware.name, 16, meta.expert_bytes, variant, "lru"))
        # configure takes the whole VRAM and leaves the buffer out itself: 16 gives the split simulated above
        assert lines[0].startswith("moe-offload configure tiny --vram-budget 16 ") == (best is latency.moepic)
        for line in lines:
            arguments = shlex.split(line.replace(" > split.json", ""))
            assert arguments[0] == "moe-offload"
            parsed = build_parser().parse_args(arguments[1:])  # argparse exits on an unknown option
            if arguments[1] in ("generate", "serve"):
                assert (parsed.policy, parsed.prefetch, parsed.model) == (best.policy, best.prefetcher, "tiny")
                assert (getattr(parsed, "split_config", None) is not None) == (best is latency.moepic)


@pytest.mark.parametrize("argv, problem", [
    (["missing.parquet", "--fast-memory", "25%"], "missing.parquet"),
    (["olmoe", "--fast-memory", "25 apples"], "--fast-memory"),
    (["olmoe", "--fast-memory", "0"], "--fast-memory"),
    (["olmoe", "--fast-memory", "200%"], "--fast-memory"),
    (["olmoe", "--fast-memory", "4"], "fewer than top-k = 8"),
    (["olmoe", "--fast-memory", "25%,50%"], "one size"),
    (["olmoe", "--fast-memory", "25%", "--hardware", "no-such-gpu"], "no-such-gpu"),
    (["olmoe", "--fast-memory", "25%", "--hardware", "{small_gpu}"], "does not fit"),
    (["olmoe", "--fast-memory", "25%", "--timed-tokens", "0"], "--timed-tokens"),
    (["olmoe", "--fast-memory", "25%", "--sample-above", "0"], "--sample-above"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, tmp_path_factory, argv, problem):
    from moe_offload.hardware.profile import PRESET_DIR

    page = tmp_path / "report.html"
    if "{small_gpu}" in argv:  # the edge preset with a GPU of 1 GiB: less than the 3 GiB asked for
        small_gpu = tmp_path_factory.mktemp("hardware") / "small-gpu.toml"
        small_gpu.write_text((PRESET_DIR / "edge-flashmoe.toml").read_text().replace('"16 GiB"', '"1 GiB"'))
        argv = [str(small_gpu) if item == "{small_gpu}" else item for item in argv]
    code, out, err = run_cli(["report", *argv, "-o", str(page)])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("moe-offload: error:") and problem in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("output, problem", [("{dir}", "is a directory"), ("{dir}/report.txt", "must end in .html"),
                                             ("/proc/report.html", "not writable")])
def test_an_unwritable_output_is_refused_before_any_work(tmp_path, output, problem):
    target = output.format(dir=tmp_path)
    code, out, err = run_cli(["report", "olmoe", "--fast-memory", "25%", "-o", target])
    assert code == 2 and out == "" and err.count("\n") == 1 and problem in err
    assert list(tmp_path.iterdir()) == []


def test_fast_memory_in_bytes_is_whole_experts():
    from moe_offload.cli.report_cmd import fast_memory_experts

    expert = 12582912
    assert fast_memory_experts("3GiB", 1024, 8, expert) == 256
    assert fast_memory_experts(f"{256 * expert + expert - 1}B", 1024, 8, expert) == 256
    assert fast_memory_experts("25%", 1024, 8, expert) == fast_memory_experts("256", 1024, 8, None) == 256
    assert np.isclose(fast_memory_experts("0.125", 1024, 8, None), 128)
    with pytest.raises(ConfigError, match="--expert-bytes"):  # bytes, but the trace does not give an expert's size
        fast_memory_experts("3GiB", 1024, 8, None)


def test_the_budget_is_the_reports_number_of_experts(tiny_trace):
    from moe_offload.values import budget_bytes

    for experts, total in ((288, 1440), (256, 1024), (7, 61 * 256), (1, 3), (2, 3)):
        held = budget_bytes(str(experts), total * 442368, "--fast-budget", expert_bytes=442368) // 442368
        assert held == experts  # as the runtime reads it

    meta = replace(tiny_trace.meta, expert_bytes=None)
    lines = command_lines(commands(meta, "tiny", "desktop-rtx4090", 16, None, None, "lcp"))
    assert lines[0] == "moe-offload generate 'Why is the sky blue?' --model tiny --fast-budget 16 --policy lcp"
    assert lines[1] == "moe-offload serve --model tiny --fast-budget 16 --policy lcp"


def test_only_prefetchers_a_runtime_can_run_are_candidates(tiny_trace):
    from moe_offload.prefetch import PREFETCHERS
    from moe_offload.reporting.latency import usable_prefetchers

    usable, why = usable_prefetchers(tiny_trace)
    assert usable and all(not PREFETCHERS[name].reads_future and not PREFETCHERS[name].needs_history
                          for name in usable)
    assert "oracle" not in usable and "moepic" not in usable  # a bound; MoEpic runs with its split
    assert len(usable) + len(why) == len(PREFETCHERS) - 2


def test_the_recommended_model_is_the_traces_hub_id_when_it_names_one():
    from moe_offload.reporting.recommend import model_argument
    from moe_offload.trace.format import TraceMeta

    assert model_argument(TraceMeta("allenai/OLMoE-1B-7B-0924", 16, 64, 8)) == "allenai/OLMoE-1B-7B-0924"
    assert model_argument(TraceMeta("moe-offload/tiny-mixtral", 8, 8, 2)) == "tiny"
    assert model_argument(TraceMeta("my model", 8, 8, 2)) == "MODEL_DIR"
