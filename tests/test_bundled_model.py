"""The bundled tiny Mixtral and its recorded trace: present, within the size limit, loadable as a transformers
model, and the recorded trace feeds every prefetcher of the papers, in the simulator and in the runtime."""

import json

import numpy as np
import pytest

from moe_offload.bundled import DEFAULT_TINY_TRACE, TINY_MODEL_DIR
from moe_offload.cli.main import main
from moe_offload.trace.format import read_trace

SIZE_LIMIT = 40 * 10 ** 6  # the limit for weights and tokenizer


def test_checkpoint_is_float16_within_the_size_limit():
    files = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert all((TINY_MODEL_DIR / name).is_file() for name in files)
    assert sum((TINY_MODEL_DIR / name).stat().st_size for name in files) <= SIZE_LIMIT
    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["dtype"] == "float16"
    assert config["num_local_experts"] >= 8 and config["num_experts_per_tok"] == 2
    assert config["num_hidden_layers"] >= 4


def test_training_report_shows_specialised_routers():
    report = json.loads((TINY_MODEL_DIR / "training-report.json").read_text())
    metrics = report["metrics"]
    trained, control = metrics["routing_trained"], metrics["routing_random_router"]
    assert trained["code_english_usage_tv_distance"] > control["code_english_usage_tv_distance"]
    for kind, value in metrics["held_out_perplexity"].items():
        assert value < metrics["held_out_perplexity_random_router"][kind] < report["recipe"]["vocab_size"]
    assert report["corpus"]["sharegpt_complete_conversations"] == 17671


def test_bundled_model_loads_through_its_adapter():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from moe_offload.models.tiny import load

    model, adapter, tokenizer = load("tiny")
    assert (adapter.num_layers, adapter.num_experts, adapter.top_k) == (8, 8, 2)
    assert adapter.stored_expert_bytes() == read_trace(DEFAULT_TINY_TRACE, columns=()).meta.expert_bytes
    assert tokenizer.decode(tokenizer("def f(x):\n    return x")["input_ids"]) == "def f(x):\n    return x"


@pytest.mark.parametrize("name", ["tiny", "tiny-history"])
def test_recorded_trace_has_every_column(name):
    from moe_offload.bundled import BUNDLED_TRACES

    trace = read_trace(BUNDLED_TRACES[name])
    assert all(getattr(trace, column) is not None
               for column in ("weights", "probs", "embedding", "gate_prediction", "next_token_gate_prediction"))
    # format 2: each token's own input embedding, which changes along a request (paper 000's per-iteration
    # semantic embedding), not the prompt's mean on every row
    assert trace.meta.embedding_kind == "token"
    decode = trace.embedding[(trace.request == trace.request[0]) & (trace.phase == 1)].astype(np.float32)
    assert len(decode) > 2 and not np.allclose(decode[1:], decode[:-1])
    sources = [r["source"].split(":")[0] for r in trace.meta.extra["recorder"]["requests"]]
    assert {"sharegpt", "humaneval"} == set(sources) and len(sources) >= 24
    np.testing.assert_allclose(trace.probs.astype(np.float32).sum(axis=2), 1.0, atol=1e-2)


@pytest.fixture(scope="module")
def tiny_requests(tmp_path_factory):
    """The bundled tiny trace's first whole requests (every column, 215 of its 7,603 rows): what a prefetcher
    reads is in each row, and the timed simulator's Python loop is what the rest would cost."""
    from moe_offload.simulator.timed.schedule import leading_iterations
    from moe_offload.trace.format import write_trace

    trace = leading_iterations(read_trace(DEFAULT_TINY_TRACE), 256)
    assert trace.num_requests >= 2
    return write_trace(trace, tmp_path_factory.mktemp("tiny") / "tiny-first-requests.parquet")


@pytest.mark.parametrize("prefetcher", ["fmoe", "moepic", "moe-infinity", "traced-topk", "oracle"])
def test_every_prefetcher_runs_on_the_bundled_trace(prefetcher, tiny_requests, tmp_path):
    out = tmp_path / "r.json"
    assert main(["simulate", str(tiny_requests), "--timed", "--policy", "lru", "--prefetch", prefetcher, "--history",
                 "tiny-history", "--cache-size", "25%", "--jobs", "1", "--timed-json", str(out)]) == 0
    runs = json.loads(out.read_text())
    assert any(run.get("prefetcher") == prefetcher for run in runs)


def test_runtime_on_the_bundled_model_matches_the_all_resident_model():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import moe_offload
    from moe_offload.models.tiny import load

    model, _, tokenizer = load("tiny")
    prompt = "User: What is a cache?\nAssistant:"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                  do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    with moe_offload.load("tiny", fast_budget="25%", policy="lcp", prefetch="fmoe") as engine:
        result = engine.generate(prompt, max_new_tokens=8)
    assert result.token_ids == expected


@pytest.mark.parametrize("where", ["a-file/model", "non-empty"])
def test_train_tiny_refuses_an_output_it_cannot_write_before_any_work(where, tmp_path, capsys, monkeypatch):
    """A file in the way, or a directory that already holds files: one line, exit 2, before the corpus is read."""
    from moe_offload.training import tiny_model

    (tmp_path / "a-file").write_text("x")
    (tmp_path / "non-empty").mkdir()
    (tmp_path / "non-empty" / "kept.txt").write_text("kept")
    monkeypatch.setattr(tiny_model, "load_corpus", lambda seed: pytest.fail("the corpus was read"))
    assert main(["train-tiny", "-o", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and str(tmp_path / where) in err, err
    assert (tmp_path / "non-empty" / "kept.txt").read_text() == "kept"
