"""vLLM and SGLang as they ship: every released encoding round-trips from the same ids, and prompt tokens
that ran no experts in their request (-1 rows, the first usage.prompt_tokens_details.cached_tokens positions)
are dropped, counted and named, or kept with --keep-cached-prompt where their ids are present."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from moe_offload.cli.main import main
from moe_offload.errors import TraceError
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.flatten import flatten
from moe_offload.trace.format import PREFILL, Trace, read_trace
from moe_offload.trace.importers import import_sglang, import_vllm
from moe_offload.trace.importers.model_config import read_model_config

from engine_formats import (interleaved_order, model_config, npy_base64, requests_of, sglang_responses,
                            vllm_responses, write_jsonl)


@pytest.fixture
def three(tiny_trace):
    return tiny_trace.select(tiny_trace.request < 3)


def shape_of(tmp_path, trace, **changes):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**model_config(trace), **changes}))
    return read_model_config(path)


def same_sequence(imported, expected_trace):
    expected = expected_trace.select(interleaved_order(expected_trace))
    np.testing.assert_array_equal(flatten(imported).expert_id, flatten(expected).expert_id)
    assert imported.num_requests == expected_trace.num_requests


@pytest.mark.parametrize("encoding,dtype", [("lists", "int16"), ("npy", "uint8"), ("npy", "uint16"),
                                            ("npy", "int32"), ("envelope", "int16"), ("envelope", "uint8")])
def test_every_vllm_encoding_round_trips(tmp_path, three, encoding, dtype):
    write_jsonl(tmp_path / "v.jsonl", vllm_responses(three, encoding=encoding, dtype=dtype))
    same_sequence(import_vllm(tmp_path / "v.jsonl", num_experts=8), three)


@pytest.mark.parametrize("dtype", ["<i4", "<u2", "u1"])
def test_every_sglang_encoding_round_trips(tmp_path, three, dtype):
    write_jsonl(tmp_path / "s.jsonl", sglang_responses(three, dtype=dtype))
    same_sequence(import_sglang(tmp_path / "s.jsonl", model_config=shape_of(tmp_path, three)), three)


def test_sglang_jax_reports_every_decoder_layer_with_minus_one_in_the_dense_ones(tmp_path, three):
    """Decoder layer 0 dense (first_k_dense_replace=1): SGLang-JAX sends 9 layers, the first all -1."""
    responses = []
    for prompt, generated in requests_of(three):
        ids = np.concatenate([prompt, generated])
        full = np.concatenate([np.full((len(ids), 1, 2), -1), ids], axis=1).astype("<i4")
        responses.append({"model": "m", "choices": [{"sgl_ext": {"routed_experts": base64.b64encode(
            full.tobytes()).decode()}}], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(generated) + 1}})
    write_jsonl(tmp_path / "s.jsonl", responses)
    shape = shape_of(tmp_path, three, num_hidden_layers=9, first_k_dense_replace=1, num_local_experts=None,
                     n_routed_experts=8)
    same_sequence(import_sglang(tmp_path / "s.jsonl", model_config=shape), three)


def prefix_cached_responses(three):
    """Request 0: its first 4 prompt rows -1 (routing not kept); request 1: cached_tokens = 5, ids present."""
    responses = vllm_responses(three, encoding="npy", dtype="int32")
    prompt, generated = requests_of(three)[0]
    rows = np.concatenate([prompt, generated]).astype(np.int32)
    rows[:4] = -1
    responses[0]["choices"][0]["routed_experts"] = npy_base64(rows)
    responses[1]["usage"]["prompt_tokens_details"] = {"cached_tokens": 5}
    return responses


def without_cached_rows(three, keep_cached=False):
    """The hand-built trace: the rows that ran the experts, nothing else."""
    keep = np.ones(three.num_tokens, bool)
    keep &= ~((three.request == 0) & (three.position < 4))
    if not keep_cached:
        keep &= ~((three.request == 1) & (three.position < 5))
    return three.select(keep)


def test_prefix_cached_prompt_rows_are_dropped_and_counted(tmp_path, three):
    write_jsonl(tmp_path / "v.jsonl", prefix_cached_responses(three))
    trace = import_vllm(tmp_path / "v.jsonl", num_experts=8)
    same_sequence(trace, without_cached_rows(three))
    prompt_total = sum(len(p) for p, _ in requests_of(three))
    assert trace.meta.extra["prompt_tokens"] == {"total": prompt_total, "from_prefix_cache": 9, "not_returned": 0,
                                                 "dropped_rows": 9, "kept_cached": False}
    assert trace.num_tokens == three.num_tokens - 9
    kept = without_cached_rows(three)
    hand_built = Trace.build(kept.meta, kept.experts[interleaved_order(kept)])  # the same rows, one request
    for policy in ("lru", "belady"):
        assert replay(ReplayInput.of(trace), policy, 16).hits == replay(ReplayInput.of(hand_built), policy, 16).hits


def test_keep_cached_prompt_keeps_the_rows_whose_ids_are_present(tmp_path, three):
    write_jsonl(tmp_path / "v.jsonl", prefix_cached_responses(three))
    trace = import_vllm(tmp_path / "v.jsonl", num_experts=8, keep_cached_prompt=True)
    same_sequence(trace, without_cached_rows(three, keep_cached=True))  # the -1 rows are never expert requests
    assert trace.meta.extra["prompt_tokens"]["dropped_rows"] == 4


def test_a_prompt_start_offset_is_counted_not_cached(tmp_path, three):
    """routed_experts_prompt_start = 3 on request 2: its first 3 rows are absent, the rest placed after them."""
    responses = vllm_responses(three, encoding="npy", dtype="uint16")
    prompt, generated = requests_of(three)[2]
    responses[2]["choices"][0]["routed_experts"] = npy_base64(np.concatenate([prompt[3:], generated]).astype("uint16"))
    write_jsonl(tmp_path / "v.jsonl", responses)
    trace = import_vllm(tmp_path / "v.jsonl", num_experts=8)
    assert trace.meta.extra["prompt_tokens"]["not_returned"] == 3
    rows = (trace.request == 2) & (trace.phase == PREFILL)
    assert trace.position[rows].tolist() == list(range(3, len(prompt)))


def test_a_fully_cached_request_without_generated_rows_is_no_request(tmp_path, three):
    responses = vllm_responses(three, encoding="npy", dtype="int32")
    prompt, _ = requests_of(three)[1]
    responses[1]["choices"][0]["routed_experts"] = npy_base64(prompt.astype(np.int32))
    responses[1]["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": 1,
                             "prompt_tokens_details": {"cached_tokens": len(prompt)}}
    write_jsonl(tmp_path / "v.jsonl", responses)
    assert import_vllm(tmp_path / "v.jsonl", num_experts=8).num_requests == 2


@pytest.mark.parametrize("rows,fragment", [
    (lambda r: r.__setitem__((0, 0, 0), -1), "some layers' expert ids are -1"),
    (lambda r: r.__setitem__(-1, -1), "generated token at position"),
])
def test_partial_or_generated_missing_routes_are_refused(tmp_path, three, rows, fragment):
    responses = vllm_responses(three, encoding="npy", dtype="int32")
    prompt, generated = requests_of(three)[1]
    ids = np.concatenate([prompt, generated]).astype(np.int32)
    rows(ids)
    responses[1]["choices"][0]["routed_experts"] = npy_base64(ids)
    write_jsonl(tmp_path / "v.jsonl", responses)
    with pytest.raises(TraceError, match=f"response 1: .*{fragment}"):
        import_vllm(tmp_path / "v.jsonl", num_experts=8)


def test_trace_info_names_the_prefix_cache(tmp_path, three, capsys):
    write_jsonl(tmp_path / "v.jsonl", prefix_cached_responses(three))
    assert main(["trace", "import", "vllm", str(tmp_path / "v.jsonl"), "--experts", "8", "-o",
                 str(tmp_path / "t.parquet")]) == 0
    capsys.readouterr()
    assert main(["trace", "info", str(tmp_path / "t.parquet")]) == 0
    out = capsys.readouterr().out
    total = sum(len(p) for p, _ in requests_of(three))
    assert f"{9 / total:.0%} of the {total:,} prompt tokens came from the prefix cache (9; dropped" in out
    assert read_trace(tmp_path / "t.parquet").meta.extra["prompt_tokens"]["from_prefix_cache"] == 9
