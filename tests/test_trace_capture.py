"""`moe-offload trace capture` end to end against `moe-offload serve` (in-process, on loopback, the bundled
tiny model): 16 prompts sent 16 at a time give back each prompt's own routing (what `record` sees, greedy,
alone), the tokens /metrics counted, and the server's batches, so that the trace's expert requests (one per
expert a pass's tokens select, per layer, as the runtime counts them), counted directly and by the timed
simulator's replay of the trace, equal /metrics' count; sent one at a
time without the server's pass numbers (as from SGLang), the arrival times alone rebuild the passes. Bad
servers and options are one-line errors with nothing written."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from moe_offload.bundled import TINY_MODEL_DIR  # noqa: E402
from moe_offload.cli.main import main  # noqa: E402
from moe_offload.hardware.profile import resolve_profile  # noqa: E402
from moe_offload.text.prompts import Prompt  # noqa: E402
from moe_offload.trace.capture import capture  # noqa: E402
from moe_offload.simulator.timed import simulate_timed  # noqa: E402
from moe_offload.trace.format import PREFILL, read_trace  # noqa: E402
from tiny_server import NEW_TOKENS, PROMPTS  # noqa: E402

@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("".join(p + "\n" for p in PROMPTS))
    return path


def scrape(server) -> dict:
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def expert_requests(metrics: dict) -> float:
    return metrics[("moe_offload_expert_requests_total", (("tier", "fast"),))]


def tokens(metrics: dict) -> float:
    return metrics[("moe_offload_prompt_tokens_total", ())] + metrics[("moe_offload_generated_tokens_total", ())]


def run_capture(capsys, server, prompt_file, output, concurrency):
    code = main(["trace", "capture", "--url", server.url, "--prompts", str(prompt_file), "--model-config", "tiny",
                 "--concurrency", str(concurrency), "--max-tokens", str(NEW_TOKENS), "-o", str(output)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return read_trace(output)


def pass_requests(trace) -> int:
    """One request per expert that a forward pass's tokens select, per layer (the runtime's accesses)."""
    L, J = trace.meta.num_layers, trace.meta.num_experts
    keys = (trace.iteration.astype(np.int64)[:, None, None] * (L * J)
            + np.arange(L)[None, :, None] * J + trace.experts.astype(np.int64))
    return int(np.unique(keys).size)


def test_sixteen_concurrent_prompts(capsys, tiny_server, prompt_file, tiny_recorded, tmp_path):
    before = scrape(tiny_server)
    trace = run_capture(capsys, tiny_server, prompt_file, tmp_path / "t.parquet", concurrency=16)
    after = scrape(tiny_server)
    assert trace.num_requests == 16
    # every token that went through the model: prompt + completion - 1 per request
    assert trace.num_tokens == tokens(after) - tokens(before) - 16
    order = trace.meta.extra["arrival_seconds"]
    assert order == sorted(order) and len(order) == 16
    # the trace's requests are in sending order: each is one prompt's routing, and every prompt's is there
    captured = sorted(trace.experts[trace.request == r].astype(np.int64).tobytes() for r in range(16))
    assert captured == sorted(expected.astype(np.int64).tobytes() for expected in tiny_recorded)
    assert pass_requests(trace) == expert_requests(after) - expert_requests(before)
    # the timed simulator replays the trace's passes as recorded: it serves as many expert requests
    replayed = simulate_timed(trace, resolve_profile("desktop-rtx4090"), "lru", 16 * trace.meta.expert_bytes)
    assert replayed.accesses == expert_requests(after) - expert_requests(before)
    batch_sizes = [np.unique(trace.request[trace.iteration == i]).size for i in np.unique(trace.iteration)]
    assert max(batch_sizes) > 1  # the server did batch them


def test_one_at_a_time_arrival_times_give_the_servers_passes(capsys, tiny_server, prompt_file, tmp_path):
    from moe_offload.trace.importers.model_config import read_model_config

    shape = read_model_config(TINY_MODEL_DIR / "config.json")
    before = scrape(tiny_server)
    # as SGLang answers: routing without the pass numbers, so the schedule comes from the times alone
    trace = capture(tiny_server.url, [Prompt(p, f"t:{i}") for i, p in enumerate(PROMPTS)], engine="sglang",
                    max_tokens=NEW_TOKENS, concurrency=1, model_config=shape)
    after = scrape(tiny_server)
    assert pass_requests(trace) == expert_requests(after) - expert_requests(before)
    # one request after the other: each prompt one prefill pass, then one pass per generated token
    first_rows = np.flatnonzero(np.r_[True, trace.request[1:] != trace.request[:-1]])
    assert (trace.phase[first_rows] == PREFILL).all()
    assert np.unique(trace.iteration[trace.phase == PREFILL]).size == 16


def test_unreachable_server_is_one_line_and_writes_nothing(capsys, prompt_file, tmp_path):
    code = main(["trace", "capture", "--url", "http://127.0.0.1:9", "--prompts", str(prompt_file),
                 "--model-config", "tiny", "-o", str(tmp_path / "t.parquet")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "cannot reach the server" in err, err
    assert not (tmp_path / "t.parquet").exists()


def test_sglang_engine_needs_a_model_config(capsys, tiny_server, prompt_file, tmp_path):
    code = main(["trace", "capture", "--url", tiny_server.url, "--prompts", str(prompt_file), "--engine", "sglang",
                 "-o", str(tmp_path / "t.parquet")])
    err = capsys.readouterr().err
    assert code == 2 and "--model-config" in err and err.count("\n") == 1, err
    assert not (tmp_path / "t.parquet").exists()


def test_bad_concurrency_is_refused_before_contacting_the_server(capsys, prompt_file, tmp_path):
    code = main(["trace", "capture", "--url", "http://127.0.0.1:9", "--prompts", str(prompt_file),
                 "--model-config", "tiny", "--concurrency", "0", "-o", str(tmp_path / "t.parquet")])
    err = capsys.readouterr().err
    assert code == 2 and "--concurrency" in err and "reach" not in err, err


@pytest.mark.parametrize("url", ["notaurl", "ftp://127.0.0.1:8000", "http://"])
def test_an_address_that_is_no_http_server_is_one_line(capsys, prompt_file, tmp_path, url):
    code = main(["trace", "capture", "--url", url, "--prompts", str(prompt_file), "--model-config", "tiny",
                 "-o", str(tmp_path / "t.parquet")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--url" in err and "Traceback" not in err, err
    assert not (tmp_path / "t.parquet").exists()


def test_an_openai_base_url_ending_in_v1_captures_the_same(capsys, tiny_server, tmp_path):
    """Issue 36: ``--url http://host:8000/v1`` fetched /v1/v1/models and failed with a bare 404."""
    prompts = tmp_path / "two.txt"
    prompts.write_text("".join(p + "\n" for p in PROMPTS[:2]))
    traces = []
    for url in (tiny_server.url, tiny_server.url + "/v1/"):
        code = main(["trace", "capture", "--url", url, "--prompts", str(prompts), "--model-config", "tiny",
                     "--concurrency", "1", "--max-tokens", "2", "-o", str(tmp_path / "t.parquet")])
        assert code == 0, capsys.readouterr().err
        traces.append(read_trace(tmp_path / "t.parquet"))
    assert np.array_equal(traces[0].experts, traces[1].experts) and traces[1].meta.model == "tiny"
