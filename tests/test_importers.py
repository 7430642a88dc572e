"""Importers of the public trace formats: real files checked against an independent reading with json,
and a TraceError naming file and line/route for every malformed input."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from moe_offload.bundled import DEFAULT_TRACE
from moe_offload.errors import ConfigError, TraceError
from moe_offload.trace.format import DECODE, PREFILL, read_trace
from moe_offload.trace.importers import IMPORTERS, import_routes_json, import_topk_jsonl

from conftest import QWEN_FILES


def test_registry_names_every_format():
    assert set(IMPORTERS) == {"topk-jsonl", "routes-json", "vllm", "sglang", "npy", "csv", "llamacpp", "megatron"}


# ------------------------------------------------------------------------------------------ real traces

def test_olmoe_jsonl_matches_an_independent_reading(olmoe_file):
    records = [json.loads(line) for line in olmoe_file.read_text().splitlines() if line.strip()]
    trace = import_topk_jsonl(olmoe_file, num_experts=64, model="allenai/OLMoE-1B-7B-0924")
    assert trace.num_tokens == len(records) == 299
    assert (trace.meta.num_layers, trace.meta.num_experts, trace.meta.top_k) == (16, 64, 8)
    assert trace.meta.model == "allenai/OLMoE-1B-7B-0924"
    np.testing.assert_array_equal(trace.experts, np.array([r["layers"] for r in records]))
    np.testing.assert_array_equal(trace.position, [r["tok"] for r in records])
    np.testing.assert_array_equal(trace.iteration, np.arange(len(records)))
    assert (trace.request == 0).all() and (trace.phase == DECODE).all()
    assert trace.weights is None and trace.probs is None
    assert trace.meta.extra["experts_sorted"] is True  # OLMoE's lists are sorted: rank order is lost


def test_bundled_trace_is_the_import_of_the_shared_file(olmoe_file):
    bundled = read_trace(DEFAULT_TRACE)
    fresh = import_topk_jsonl(olmoe_file, num_experts=64)
    np.testing.assert_array_equal(bundled.experts, fresh.experts)
    np.testing.assert_array_equal(bundled.position, fresh.position)
    meta = bundled.meta
    assert meta.model == "allenai/OLMoE-1B-7B-0924" and meta.license == "Apache-2.0"
    assert meta.expert_bytes == 3 * 2048 * 1024 * 2 and meta.hidden_size == 2048
    assert "sqliteai/warp" in meta.source and "7f1fbba3cbaee0e9fdaffd940d87ff2dba9ee09b" in meta.source
    assert meta.extra["prompt"].startswith("Write a C function that parses a JSON array")


def test_qwen_routes_match_an_independent_reading(qwen_folder):
    path = qwen_folder / "cooking_1.json"
    document = json.loads(path.read_text())
    routes = document["routes"]
    trace = import_routes_json(path)
    meta = document["meta"]
    assert trace.num_tokens == len(routes) == meta["total_tokens"]
    assert (trace.meta.num_layers, trace.meta.num_experts, trace.meta.top_k) == (24, 60, 4)
    assert trace.meta.model == meta["model_id"]
    layers = [str(i) for i in range(24)]
    np.testing.assert_array_equal(trace.experts, [[r["layers"][l]["experts"] for l in layers] for r in routes])
    np.testing.assert_array_equal(trace.weights,
                                  np.array([[r["layers"][l]["weights"] for l in layers] for r in routes],
                                           dtype=np.float16))
    assert trace.weights.dtype == np.float16
    np.testing.assert_array_equal(trace.position, [r["token_pos"] for r in routes])
    np.testing.assert_array_equal(trace.phase, [PREFILL if r["phase"] == "prefill" else DECODE for r in routes])


def test_the_prompt_is_one_prefill_iteration(qwen_folder):
    document = json.loads((qwen_folder / "history_2.json").read_text())
    prompt, generated = len(document["prompt_tokens"]), len(document["generated_tokens"])
    trace = import_routes_json(qwen_folder / "history_2.json")
    assert (trace.phase[:prompt] == PREFILL).all() and (trace.phase[prompt:] == DECODE).all()
    assert (trace.iteration[:prompt] == 0).all()
    np.testing.assert_array_equal(trace.iteration[prompt:], np.arange(1, generated + 1))


def test_six_qwen_files_become_six_requests(qwen_folder):
    paths = [qwen_folder / f"{name}.json" for name in QWEN_FILES]
    route_counts = [len(json.loads(p.read_text())["routes"]) for p in paths]
    trace = import_routes_json(paths)
    assert trace.num_tokens == sum(route_counts)
    assert trace.num_requests == 6
    np.testing.assert_array_equal(trace.request, np.repeat(np.arange(6), route_counts))
    assert (np.diff(trace.iteration) >= 0).all()
    # One prefill iteration plus one per generated token, in every request; none shared between requests.
    assert np.unique(trace.iteration).size == sum(1 + 128 for _ in paths)
    for request in range(6):
        own = set(trace.iteration[trace.request == request].tolist())
        others = set(trace.iteration[trace.request != request].tolist())
        assert not own & others
    assert [r["file"] for r in trace.meta.extra["requests"]] == [p.name for p in paths]


def test_a_manifest_split_is_a_subset_of_files(qwen_folder):
    manifest = json.loads((qwen_folder / "manifest.json").read_text())
    experiment = manifest["experiments"][0]
    train = import_routes_json([qwen_folder / f"{name}.json" for name in experiment["train_ids"]])
    test = import_routes_json([qwen_folder / f"{name}.json" for name in experiment["test_ids"]])
    assert train.num_requests == len(experiment["train_ids"])
    assert test.num_requests == len(experiment["test_ids"])


def test_topk_jsonl_needs_the_number_of_experts(olmoe_file):
    with pytest.raises(ConfigError, match="--experts") as caught:
        import_topk_jsonl(olmoe_file)
    assert "63" in str(caught.value) and str(olmoe_file) in str(caught.value)


def test_caller_and_file_disagree_on_the_number_of_experts(qwen_folder):
    with pytest.raises(TraceError, match="num_experts=60"):
        import_routes_json(qwen_folder / "ml_moe_1.json", num_experts=64)


def test_several_jsonl_files_become_requests(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [row(1), row(2)])
    second = write_jsonl(tmp_path / "b.jsonl", [row(1), row(2), row(3)])
    trace = import_topk_jsonl([first, second], num_experts=8)
    np.testing.assert_array_equal(trace.request, [0, 0, 1, 1, 1])
    np.testing.assert_array_equal(trace.iteration, np.arange(5))
    np.testing.assert_array_equal(trace.position, [1, 2, 1, 2, 3])
    assert trace.meta.extra["experts_sorted"] is False


def test_lines_cut_into_requests_with_their_prompts(tmp_path):
    # 6 lines as 2 requests of 3: each a prompt of 2 lines (one prefill pass) and one decode token
    path = write_jsonl(tmp_path / "a.jsonl", [row(t) for t in range(6)])
    trace = import_topk_jsonl(path, num_experts=8, request_rows=3, prompt_rows=2)
    np.testing.assert_array_equal(trace.request, [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(trace.iteration, [0, 0, 1, 2, 2, 3])
    np.testing.assert_array_equal(trace.position, [0, 1, 2, 0, 1, 2])
    np.testing.assert_array_equal(trace.phase, [PREFILL, PREFILL, DECODE] * 2)
    np.testing.assert_array_equal(trace.experts, import_topk_jsonl(path, num_experts=8).experts)
    # a prompt alone keeps the file's positions
    alone = import_topk_jsonl(path, num_experts=8, prompt_rows=4)
    np.testing.assert_array_equal(alone.iteration, [0, 0, 0, 0, 1, 2])
    np.testing.assert_array_equal(alone.position, np.arange(6))
    with pytest.raises(TraceError, match="6 routing lines are not whole requests of --request-rows 4"):
        import_topk_jsonl(path, num_experts=8, request_rows=4)
    with pytest.raises(ConfigError, match="--prompt-rows 3 leaves no decode line"):
        import_topk_jsonl(path, num_experts=8, request_rows=3, prompt_rows=3)
    with pytest.raises(TraceError, match="--prompt-rows 6 leaves no decode line in its 6 lines"):
        import_topk_jsonl(path, num_experts=8, prompt_rows=6)
    with pytest.raises(ConfigError, match="--request-rows"):
        import_topk_jsonl(path, num_experts=8, request_rows=0)


def test_the_granite_recording_is_eight_requests_of_a_prompt_and_nineteen_decode_steps(shared_traces):
    """Its notes: 8 requests one after another, each an 8-token prompt, then 19 decode steps (27 lines)."""
    path = shared_traces / "granite-3.0-1b-a400m" / "sglang_8_requests.jsonl"
    trace = import_topk_jsonl(path, num_experts=32, request_rows=27, prompt_rows=8)
    assert trace.num_requests == 8 and trace.num_tokens == 216
    assert len(np.unique(trace.iteration)) == 8 * 20
    assert int((trace.phase == PREFILL).sum()) == 64
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    np.testing.assert_array_equal(trace.experts, np.array([line["layers"] for line in lines]))


# ----------------------------------------------------------------------------------- malformed topk-jsonl

def row(token, layers=None):
    """A valid line for L=3, J=8, K=2; expert lists deliberately unsorted."""
    return {"tok": token, "layers": layers or [[token % 8, (token + 3) % 8], [5, 1], [2, 7]]}


def write_jsonl(path: Path, records, raw_tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + raw_tail)
    return path


def expect_jsonl_error(path, line, *fragments, num_experts=8):
    with pytest.raises(TraceError) as caught:
        import_topk_jsonl(path, num_experts=num_experts)
    message = str(caught.value)
    assert str(path) in message
    if line is not None:
        assert f"line {line}:" in message, message
        assert caught.value.row == line
    for fragment in fragments:
        assert fragment in message, message


def test_jsonl_missing_file(tmp_path):
    expect_jsonl_error(tmp_path / "absent.jsonl", None, "no such file")


def test_jsonl_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    expect_jsonl_error(path, None, "no routing rows")


def test_jsonl_invalid_json_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row(1)) + "\n{tok: 2,]\n" + json.dumps(row(3)) + "\n")
    expect_jsonl_error(path, 2, "invalid JSON")


def test_jsonl_truncated_last_line(tmp_path):
    path = write_jsonl(tmp_path / "cut.jsonl", [row(1), row(2)], raw_tail=json.dumps(row(3))[:25])
    expect_jsonl_error(path, 3, "invalid JSON", "truncated")


def test_jsonl_wrong_number_of_layers(tmp_path):
    path = write_jsonl(tmp_path / "layers.jsonl", [row(1), row(2, [[1, 2], [3, 4]]), row(3)])
    expect_jsonl_error(path, 2, "2 layers", "line 1 has 3")


def test_jsonl_expert_id_too_large(tmp_path):
    path = write_jsonl(tmp_path / "big.jsonl", [row(1), row(2), row(3, [[0, 1], [2, 3], [4, 8]])])
    expect_jsonl_error(path, 3, "layer 2", "out of range 0..7")


def test_jsonl_negative_expert_id(tmp_path):
    path = write_jsonl(tmp_path / "neg.jsonl", [row(1), row(2, [[0, 1], [-1, 3], [4, 5]])])
    expect_jsonl_error(path, 2, "layer 1", "out of range")


def test_jsonl_duplicated_expert(tmp_path):
    path = write_jsonl(tmp_path / "dup.jsonl", [row(1), row(2, [[0, 1], [3, 3], [4, 5]])])
    expect_jsonl_error(path, 2, "layer 1", "twice")


def test_jsonl_k_mismatch(tmp_path):
    path = write_jsonl(tmp_path / "k.jsonl", [row(1), row(2), row(3, [[0, 1], [2, 3, 4], [5, 6]])])
    expect_jsonl_error(path, 3, "layer 1 lists 3 experts")


def test_jsonl_missing_key(tmp_path):
    path = write_jsonl(tmp_path / "key.jsonl", [row(1), {"layers": row(2)["layers"]}])
    expect_jsonl_error(path, 2, "'tok'")


def test_jsonl_non_integer_expert(tmp_path):
    path = write_jsonl(tmp_path / "float.jsonl", [row(1), row(2, [[0, 1.5], [2, 3], [4, 5]])])
    expect_jsonl_error(path, 2, "not an integer")


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = write_jsonl(tmp_path / "list.jsonl", [row(1), [1, 2, 3]])
    expect_jsonl_error(path, 2, "JSON object")


def test_jsonl_second_file_with_other_shape(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [row(1)])
    second = write_jsonl(tmp_path / "b.jsonl", [row(1, [[0, 1], [2, 3]])])
    with pytest.raises(TraceError) as caught:
        import_topk_jsonl([first, second], num_experts=8)
    assert str(second) in str(caught.value) and "line 1:" in str(caught.value)


# ---------------------------------------------------------------------------------- malformed routes-json

def routes_document(prompt=2, generated=3, num_layers=2, top_k=2):
    """A valid routes-json document: J=6."""
    def route(position, phase):
        return {"token_pos": position, "token_id": 100 + position, "token_str": f"t{position}", "phase": phase,
                "layers": {str(layer): {"experts": [(position + layer + i) % 6 for i in range(top_k)],
                                        "weights": [0.5 / (i + 1) for i in range(top_k)]}
                           for layer in range(num_layers)}}
    return {"meta": {"model_id": "tiny", "num_layers": num_layers, "num_moe_layers": num_layers,
                     "num_experts": 6, "top_k": top_k},
            "prompt_tokens": list(range(prompt)), "generated_tokens": list(range(generated)),
            "routes": [route(p, "prefill" if p < prompt else "decode") for p in range(prompt + generated)]}


def write_json(path: Path, document) -> Path:
    path.write_text(json.dumps(document, indent=1))
    return path


def expect_routes_error(path, where, *fragments):
    """``where`` is "route N", "line N" or None (the whole file is to blame)."""
    with pytest.raises(TraceError) as caught:
        import_routes_json(path)
    message = str(caught.value)
    assert str(path) in message
    if where is not None:
        assert f"{where}:" in message, message
    for fragment in fragments:
        assert fragment in message, message


def broken(mutate):
    document = routes_document()
    mutate(document)
    return document


def test_the_small_routes_document_is_valid(tmp_path):
    trace = import_routes_json(write_json(tmp_path / "ok.json", routes_document()))
    np.testing.assert_array_equal(trace.iteration, [0, 0, 1, 2, 3])
    np.testing.assert_array_equal(trace.phase, [PREFILL, PREFILL, DECODE, DECODE, DECODE])
    assert trace.meta.model == "tiny" and trace.weights is not None


def test_decode_only_routes_start_at_iteration_zero(tmp_path):
    trace = import_routes_json(write_json(tmp_path / "decode.json", routes_document(prompt=0)))
    np.testing.assert_array_equal(trace.iteration, [0, 1, 2])


def test_routes_missing_file(tmp_path):
    expect_routes_error(tmp_path / "absent.json", None, "no such file")


def test_routes_invalid_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"meta": {},\n "routes": [1, 2,, 3]}\n')
    expect_routes_error(path, "line 2", "invalid JSON")


def test_routes_truncated_file(tmp_path):
    path = write_json(tmp_path / "cut.json", routes_document())
    cut = path.read_text()[: len(path.read_text()) * 2 // 3]
    path.write_text(cut)
    expect_routes_error(path, f"line {cut.count(chr(10)) + 1}", "invalid JSON", "truncated")


def test_routes_key_missing(tmp_path):
    path = write_json(tmp_path / "noroutes.json", broken(lambda d: d.pop("routes")))
    expect_routes_error(path, None, "'routes'")


def test_route_without_phase(tmp_path):
    path = write_json(tmp_path / "nophase.json", broken(lambda d: d["routes"][3].pop("phase")))
    expect_routes_error(path, "route 3", "'phase'")


def test_route_layer_without_weights(tmp_path):
    path = write_json(tmp_path / "noweights.json", broken(lambda d: d["routes"][1]["layers"]["1"].pop("weights")))
    expect_routes_error(path, "route 1", "layer 1", "'weights'")


def test_route_with_more_weights_than_experts(tmp_path):
    path = write_json(tmp_path / "weights.json",
                      broken(lambda d: d["routes"][2]["layers"]["0"]["weights"].append(0.1)))
    expect_routes_error(path, "route 2", "3 weights for 2 experts")


def test_route_k_mismatch(tmp_path):
    def three_experts(document):
        layer = document["routes"][4]["layers"]["1"]
        layer["experts"].append(5)
        layer["weights"].append(0.1)
    path = write_json(tmp_path / "k.json", broken(three_experts))
    expect_routes_error(path, "route 4", "lists 3 experts")


def test_route_expert_id_too_large(tmp_path):
    path = write_json(tmp_path / "big.json", broken(lambda d: d["routes"][2]["layers"]["1"].update(experts=[0, 6])))
    expect_routes_error(path, "route 2", "layer 1", "out of range 0..5")


def test_route_negative_expert_id(tmp_path):
    path = write_json(tmp_path / "neg.json", broken(lambda d: d["routes"][0]["layers"]["0"].update(experts=[-2, 1])))
    expect_routes_error(path, "route 0", "out of range")


def test_route_duplicated_expert(tmp_path):
    path = write_json(tmp_path / "dup.json", broken(lambda d: d["routes"][3]["layers"]["0"].update(experts=[4, 4])))
    expect_routes_error(path, "route 3", "twice")


def test_route_missing_a_layer(tmp_path):
    path = write_json(tmp_path / "layer.json", broken(lambda d: d["routes"][2]["layers"].pop("1")))
    expect_routes_error(path, "route 2", "layers")


def test_route_with_unknown_phase(tmp_path):
    path = write_json(tmp_path / "phase.json", broken(lambda d: d["routes"][1].update(phase="warmup")))
    expect_routes_error(path, "route 1", "warmup")


def test_prefill_route_after_decode(tmp_path):
    path = write_json(tmp_path / "order.json", broken(lambda d: d["routes"][3].update(phase="prefill")))
    expect_routes_error(path, "route 3", "prefill route after a decode route")


def test_negative_weight(tmp_path):
    path = write_json(tmp_path / "negw.json",
                      broken(lambda d: d["routes"][2]["layers"]["0"].update(weights=[0.5, -0.1])))
    expect_routes_error(path, "route 2", "weight -0.1")


def test_routes_missing_tokens_listed_by_the_file(tmp_path):
    path = write_json(tmp_path / "count.json", broken(lambda d: d["generated_tokens"].append(7)))
    expect_routes_error(path, None, "3 decode routes", "4 tokens")


def test_meta_layer_count_disagrees_with_routes(tmp_path):
    path = write_json(tmp_path / "nlayers.json", broken(lambda d: d["meta"].update(num_moe_layers=3)))
    expect_routes_error(path, None, "num_moe_layers=3")


def test_second_routes_file_disagrees_on_experts(tmp_path):
    first = write_json(tmp_path / "a.json", routes_document())
    other = copy.deepcopy(routes_document())
    other["meta"]["num_experts"] = 7
    second = write_json(tmp_path / "b.json", other)
    with pytest.raises(TraceError) as caught:
        import_routes_json([first, second])
    assert str(second) in str(caught.value) and "num_experts=7" in str(caught.value)


def test_routes_without_num_experts_anywhere(tmp_path):
    path = write_json(tmp_path / "noj.json", broken(lambda d: d["meta"].pop("num_experts")))
    with pytest.raises(ConfigError, match="--experts"):
        import_routes_json(path)
    assert import_routes_json(path, num_experts=6).meta.num_experts == 6


def test_the_fallback_olmoe_file_equals_the_shared_one(shared_traces, tmp_path):
    """Without ../shared the tests read decode_299.jsonl rebuilt from the shipped trace: line for line the
    same records as the original."""
    from conftest import write_olmoe_jsonl

    original = shared_traces / "olmoe-1b-7b" / "decode_299.jsonl"
    rebuilt = write_olmoe_jsonl(tmp_path / "decode_299.jsonl")
    def parse(path):
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert parse(rebuilt) == parse(original)
