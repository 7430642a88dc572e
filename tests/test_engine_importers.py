"""`trace import vllm|sglang|npy`: round trips through each engine's format (written by tests/engine_formats.py
from the bundled and the shared traces) give back the same request sequence, and every malformed input is
one line naming the file, the response and the problem, with nothing written."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from moe_offload.cli.main import main
from moe_offload.errors import ConfigError, TraceError
from moe_offload.trace.flatten import flatten
from moe_offload.trace.format import DECODE, PREFILL, read_trace
from moe_offload.trace.importers import import_npy, import_routes_json, import_sglang, import_vllm
from moe_offload.trace.importers.model_config import read_model_config

from engine_formats import (interleaved_order, model_config, requests_of, sglang_responses, vllm_responses,
                            write_jsonl)


def config_file(tmp_path, trace, **changes):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**model_config(trace), **changes}))
    return path


def assert_same_sequence(imported, original):
    """The imported trace serves the original's expert requests, in the order of the continuous-batching
    schedule worked out independently (engine_formats.interleaved_order)."""
    expected = original.select(interleaved_order(original))
    np.testing.assert_array_equal(flatten(imported).expert_id, flatten(expected).expert_id)
    np.testing.assert_array_equal(imported.phase, expected.phase)
    assert imported.num_requests == original.num_requests


@pytest.fixture(scope="module")
def qwen_trace(qwen_folder):
    return import_routes_json([qwen_folder / "history_1.json", qwen_folder / "cooking_1.json"])


# ---------------------------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("encoding", ["lists", "npy"])
def test_vllm_round_trip_of_the_bundled_trace(tmp_path, tiny_trace, encoding):
    source = tmp_path / "vllm.jsonl"
    write_jsonl(source, vllm_responses(tiny_trace, encoding=encoding))
    imported = import_vllm(source, num_experts=tiny_trace.meta.num_experts)
    assert_same_sequence(imported, tiny_trace)
    assert imported.meta.model == "m" and imported.meta.extra["importer"] == "vllm"


def test_sglang_round_trip_of_the_bundled_trace(tmp_path, tiny_trace):
    source = tmp_path / "sglang.json"
    source.write_text(json.dumps(sglang_responses(tiny_trace), indent=1))  # one JSON document, a list
    imported = import_sglang(source, model_config=read_model_config(config_file(tmp_path, tiny_trace)))
    assert_same_sequence(imported, tiny_trace)
    assert imported.meta.expert_bytes == 3 * 4 * 8 * 4  # 3 matrices of hidden x intermediate float32


def test_round_trips_of_a_shared_trace(tmp_path, qwen_trace):
    J = qwen_trace.meta.num_experts
    write_jsonl(tmp_path / "v.jsonl", vllm_responses(qwen_trace))
    write_jsonl(tmp_path / "s.jsonl", sglang_responses(qwen_trace))
    shape = read_model_config(config_file(tmp_path, qwen_trace))
    assert_same_sequence(import_vllm(tmp_path / "v.jsonl", num_experts=J), qwen_trace)
    assert_same_sequence(import_sglang(tmp_path / "s.jsonl", model_config=shape), qwen_trace)


def test_npy_round_trip_of_the_shared_olmoe_trace(tmp_path, olmoe_file):
    from moe_offload.trace.importers import import_topk_jsonl

    original = import_topk_jsonl(olmoe_file, num_experts=64)
    np.save(tmp_path / "a.npy", original.experts.astype(np.int64))
    imported = import_npy(tmp_path / "a.npy", num_experts=64)
    np.testing.assert_array_equal(flatten(imported).expert_id, flatten(original).expert_id)
    assert (imported.phase == DECODE).all()


def test_npz_holds_one_request_per_array(tmp_path):
    first, second = np.zeros((2, 3, 1), np.int32), np.ones((3, 3, 1), np.int32)
    np.savez(tmp_path / "r.npz", first=first, second=second)
    trace = import_npy(tmp_path / "r.npz", num_experts=2)
    # request 0 joins at pass 0 (rows at 0, 1), request 1 at pass 1 (rows at 1, 2, 3)
    assert trace.request.tolist() == [0, 0, 1, 1, 1]
    assert trace.iteration.tolist() == [0, 1, 1, 2, 3]


def test_many_files_are_read_one_at_a_time_and_each_told_done(tmp_path, monkeypatch):
    from moe_offload.trace.importers import engines

    files = []
    for number in range(4):
        np.save(tmp_path / f"r{number}.npy", np.full((number + 1, 3, 1), number % 2, np.int32))
        files.append(tmp_path / f"r{number}.npy")
    events = []
    read = engines._arrays
    monkeypatch.setattr(engines, "_arrays", lambda path, limit: events.append(f"read {path.name}") or read(path, limit))
    trace = import_npy(files, num_experts=2, on_file=lambda: events.append("done"))
    assert events == [event for number in range(4) for event in (f"read r{number}.npy", "done")]
    assert trace.num_requests == 4 and trace.num_tokens == 1 + 2 + 3 + 4


def test_vllm_offline_npz_splits_prompt_and_generation(tmp_path, tiny_trace):
    prompt, generated = requests_of(tiny_trace)[0]
    np.savez(tmp_path / "a.npz", routed_experts=np.concatenate([prompt, generated]), num_prompt_tokens=len(prompt))
    np.savez(tmp_path / "b.npz", prompt_routed_experts=prompt, routed_experts=generated)
    for name in ("a.npz", "b.npz"):
        trace = import_vllm(tmp_path / name, num_experts=8)
        assert (trace.phase == PREFILL).sum() == len(prompt) and (trace.phase == DECODE).sum() == len(generated)
        assert (trace.iteration[trace.phase == PREFILL] == 0).all()
        assert trace.iteration[trace.phase == DECODE].tolist() == list(range(1, len(generated) + 1))


def test_sglang_offset_drops_the_first_prompt_rows(tmp_path, tiny_trace):
    """routed_experts_start_len = S: the rows of positions [S, prompt + completion - 1) only."""
    response = sglang_responses(tiny_trace)[0]
    prompt, generated = requests_of(tiny_trace)[0]
    ids = np.concatenate([prompt[3:], generated]).astype("<i4")
    response["choices"][0]["sgl_ext"]["routed_experts"] = base64.b64encode(ids.tobytes()).decode()
    write_jsonl(tmp_path / "s.jsonl", [response])
    trace = import_sglang(tmp_path / "s.jsonl", model_config=read_model_config(config_file(tmp_path, tiny_trace)))
    assert (trace.phase == PREFILL).sum() == len(prompt) - 3
    np.testing.assert_array_equal(trace.experts, np.concatenate([prompt[3:], generated]))


def test_arrival_order_follows_created(tmp_path, tiny_trace):
    responses = vllm_responses(tiny_trace.select(tiny_trace.request < 2))
    responses[0]["created"], responses[1]["created"] = 20, 10
    write_jsonl(tmp_path / "v.jsonl", responses)
    trace = import_vllm(tmp_path / "v.jsonl", num_experts=8)
    first_prompt = len(responses[1]["prompt_routed_experts"])
    np.testing.assert_array_equal(trace.experts[:first_prompt], responses[1]["prompt_routed_experts"])


def test_model_config_reads_deepseek_dense_layers(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"num_hidden_layers": 4, "n_routed_experts": 16, "num_experts_per_tok": 2,
                                "first_k_dense_replace": 1, "moe_intermediate_size": 8, "hidden_size": 4,
                                "torch_dtype": "bfloat16"}))
    shape = read_model_config(path)
    assert shape.moe_layers == (1, 2, 3) and (shape.num_experts, shape.top_k) == (16, 2)
    assert shape.expert_bytes == 3 * 4 * 8 * 2


# ---------------------------------------------------------------------------------------------------- CLI

def run(capsys, *argv):
    code = main(["trace", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_import_sglang(capsys, tmp_path, tiny_trace):
    write_jsonl(tmp_path / "s.jsonl", sglang_responses(tiny_trace))
    output = tmp_path / "t.parquet"
    code, out, _ = run(capsys, "import", "sglang", tmp_path / "s.jsonl", "--model-config",
                       config_file(tmp_path, tiny_trace), "-o", output)
    assert code == 0 and "48 request(s)" in out
    assert_same_sequence(read_trace(output), tiny_trace)


def _bad_inputs(tiny_trace):
    """(format, mutate the responses, fragment of the error)."""
    def set_routing(value):
        def mutate(responses):
            responses[1]["choices"][0]["sgl_ext"]["routed_experts"] = value
        return mutate

    def drop(responses):
        del responses[1]["choices"][0]["sgl_ext"]

    def other_model(responses):
        responses[1]["model"] = "another"

    def big_id(responses):
        prompt, generated = requests_of(tiny_trace)[1]
        ids = np.concatenate([prompt, generated]).astype("<i4")
        ids[0, 0, 0] = 8
        responses[1]["choices"][0]["sgl_ext"]["routed_experts"] = base64.b64encode(ids.tobytes()).decode()

    return [
        ("wrong base64", set_routing("not base64!"), "not valid base64"),
        ("ragged bytes", set_routing(base64.b64encode(b"12345").decode()), "whole number of int32"),
        ("shape", set_routing(base64.b64encode(np.zeros(3, "<i4").tobytes()).decode()), "8 layers x top-2"),
        ("no routing", drop, "no routing"),
        ("mixed models", other_model, "'another'"),
        ("id >= J", big_id, "out of range 0..7"),
    ]


@pytest.mark.parametrize("case", range(6))
def test_cli_bad_sglang_input_is_one_line_naming_file_and_response(capsys, tmp_path, tiny_trace, case):
    _, mutate, fragment = _bad_inputs(tiny_trace)[case]
    responses = sglang_responses(tiny_trace.select(tiny_trace.request < 3))
    mutate(responses)
    source = tmp_path / "s.jsonl"
    write_jsonl(source, responses)
    output = tmp_path / "t.parquet"
    code, _, err = run(capsys, "import", "sglang", source, "--model-config", config_file(tmp_path, tiny_trace),
                       "-o", output)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{source}: response 1: " in err and fragment in err, err
    assert not output.exists()


def test_vllm_shape_disagreeing_with_the_config(tmp_path, tiny_trace):
    write_jsonl(tmp_path / "v.jsonl", vllm_responses(tiny_trace.select(tiny_trace.request < 2)))
    shape = read_model_config(config_file(tmp_path, tiny_trace, num_experts_per_tok=3))
    with pytest.raises(TraceError, match=r"response 0: routing of 8 layers x top-2, but the model config has 8 MoE "
                                         r"layers x top-3"):
        import_vllm(tmp_path / "v.jsonl", model_config=shape)


def test_vllm_without_routing_or_experts(tmp_path, tiny_trace):
    responses = vllm_responses(tiny_trace.select(tiny_trace.request < 2))
    write_jsonl(tmp_path / "v.jsonl", responses)
    with pytest.raises(ConfigError, match="--experts J or --model-config"):
        import_vllm(tmp_path / "v.jsonl")
    del responses[1]["prompt_routed_experts"], responses[1]["choices"][0]["routed_experts"]
    write_jsonl(tmp_path / "v.jsonl", responses)
    with pytest.raises(TraceError, match="response 1: no routing"):
        import_vllm(tmp_path / "v.jsonl", num_experts=8)


def test_sglang_needs_a_model_config(tmp_path, tiny_trace):
    write_jsonl(tmp_path / "s.jsonl", sglang_responses(tiny_trace))
    with pytest.raises(ConfigError, match="--model-config"):
        import_sglang(tmp_path / "s.jsonl")


def test_hostile_array_files(tmp_path):
    (tmp_path / "text.npz").write_text("not a zip")
    np.save(tmp_path / "floats.npy", np.zeros((2, 3, 2)))
    np.savez(tmp_path / "split.npz", routed_experts=np.zeros((4, 3, 2), np.int32))
    with pytest.raises(TraceError, match="not an .npz archive"):
        import_npy(tmp_path / "text.npz", num_experts=4)
    with pytest.raises(TraceError, match="array 0: .*must be integers, not float64"):
        import_npy(tmp_path / "floats.npy", num_experts=4)
    with pytest.raises(TraceError, match="prompt/generation split is missing"):
        import_vllm(tmp_path / "split.npz", num_experts=4)
    with pytest.raises(ConfigError, match="--experts"):  # refused before the file is read
        import_vllm(tmp_path / "missing.jsonl", num_experts=0)


def test_sglang_top_level_sglext_and_generate_answers(tmp_path, tiny_trace):
    """Later SGLang releases put the extension on the response (``sglext``); /generate answers carry it in
    ``meta_info``: both read as the choice's ``sgl_ext``."""
    two = tiny_trace.select(tiny_trace.request < 2)
    first, second = sglang_responses(two)
    first["sglext"] = first["choices"][0].pop("sgl_ext")
    native = {"text": "x", "meta_info": {"routed_experts": second["choices"][0]["sgl_ext"]["routed_experts"],
                                         **second["usage"]}}
    write_jsonl(tmp_path / "s.jsonl", [first, native])
    trace = import_sglang(tmp_path / "s.jsonl", model_config=read_model_config(config_file(tmp_path, tiny_trace)))
    assert_same_sequence(trace, two)


def test_vllm_choices_share_the_prompt(tmp_path, tiny_trace):
    """n > 1: each choice is a request of its own, with the response's prompt rows."""
    (prompt, first), (_, second) = requests_of(tiny_trace)[:2]
    response = {"model": "m", "prompt_routed_experts": prompt.tolist(), "usage": {"prompt_tokens": len(prompt)},
                "choices": [{"index": 0, "routed_experts": first.tolist()},
                            {"index": 1, "routed_experts": second.tolist()}]}
    write_jsonl(tmp_path / "v.jsonl", [response])
    trace = import_vllm(tmp_path / "v.jsonl", num_experts=8)
    assert trace.num_requests == 2
    for request, generated in ((0, first), (1, second)):
        rows = trace.request == request
        np.testing.assert_array_equal(trace.experts[rows & (trace.phase == PREFILL)], prompt)
        np.testing.assert_array_equal(trace.experts[rows & (trace.phase == DECODE)], generated)
