"""Hostile importer and model-config inputs (issue #33): each is one line naming the input and the problem,
exit 2, nothing written, in bounded time and memory, quoting at most a few hundred bytes of what it got."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from moe_offload.cli.main import main

from engine_formats import model_config, sglang_responses, vllm_responses, write_jsonl

def huge_npy() -> bytes:
    """A valid .npy header claiming 2**40 x 12 int64 (96 TiB), followed by 16 bytes of data."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<i8", "fortran_order": False,
                                                  "shape": (2**40, 12)})
    return buffer.getvalue() + bytes(16)


def run_import(capsys, tmp_path, fmt, source, *extra):
    output = tmp_path / "out.parquet"
    code = main(["trace", "import", fmt, str(source), "-o", str(output), *map(str, extra)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and len(err) < 700, err
    assert not output.exists()
    return err


@pytest.fixture
def two(tiny_trace):
    return tiny_trace.select(tiny_trace.request < 2)


@pytest.fixture
def config(tmp_path, two):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(model_config(two)))
    return path


def vllm_with(two, mutate):
    responses = vllm_responses(two, encoding="npy")
    mutate(responses[1])
    return responses


VLLM_CASES = {
    "nested deeply in the routing": (lambda r: r["choices"][0].__setitem__("routed_experts", json.loads(
        "[" * 500 + "]" * 500)), "not [tokens][layers][top_k]"),
    "a list as the dtype": (lambda r: r["choices"][0].__setitem__("routed_experts", {
        "encoding": "base64", "dtype": ["int32"], "shape": [1, 8, 2], "data": ""}), "dtype ['int32']"),
    "a shape whose product overflows": (lambda r: r["choices"][0].__setitem__("routed_experts", {
        "encoding": "base64", "dtype": "int32", "shape": [2**32, 2**32, 1], "data": ""}), "--max-array-bytes"),
    "a list as prompt_tokens": (lambda r: r["usage"].__setitem__("prompt_tokens", [1] * 10000),
                                "usage.prompt_tokens must be an integer"),
    "a list as the model": (lambda r: r.__setitem__("model", [["m"]]), "model must be a string"),
    "a string as a choice": (lambda r: r.__setitem__("choices", ["x"]), "choices[0] must be an object"),
    "a 96 TiB .npy header": (lambda r: r["choices"][0].__setitem__("routed_experts", base64.b64encode(
        huge_npy()).decode()), "--max-array-bytes"),
    "cached_tokens above the prompt": (lambda r: r["usage"].__setitem__("prompt_tokens_details", {
        "cached_tokens": 10**6}), "exceeds the"),
    "a string as prompt_tokens_details": (lambda r: r["usage"].__setitem__("prompt_tokens_details", "x"),
                                          "prompt_tokens_details must be an object"),
}


@pytest.mark.parametrize("case", sorted(VLLM_CASES))
def test_hostile_vllm_responses(capsys, tmp_path, two, case):
    mutate, fragment = VLLM_CASES[case]
    source = tmp_path / "v.jsonl"
    write_jsonl(source, vllm_with(two, mutate))
    err = run_import(capsys, tmp_path, "vllm", source, "--experts", 8)
    assert f"{source}: response 1: " in err and fragment in err, err


def test_a_response_file_nested_past_the_parser(capsys, tmp_path):
    source = tmp_path / "v.json"
    source.write_text("[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in run_import(capsys, tmp_path, "vllm", source, "--experts", 8)


SGLANG_CASES = {
    "sgl_ext as a string": (lambda r: r["choices"][0].__setitem__("sgl_ext", "x"), "sgl_ext must be an object"),
    "sglext as a list": (lambda r: r.__setitem__("sglext", [1]), "sglext must be an object"),
    "meta_info as a string": (lambda r: (r.pop("choices"), r.__setitem__("meta_info", "x")),
                              "meta_info must be an object"),
    "meta_info.prompt_tokens -3": (lambda r: (r.pop("choices"), r.__setitem__("meta_info", {
        "prompt_tokens": -3, "completion_tokens": 9, "routed_experts": ""})), "meta_info.prompt_tokens must be"),
    "meta_info.prompt_tokens true": (lambda r: (r.pop("choices"), r.__setitem__("meta_info", {
        "prompt_tokens": True, "completion_tokens": 9, "routed_experts": ""})), "not True"),
}


@pytest.mark.parametrize("case", sorted(SGLANG_CASES))
def test_hostile_sglang_responses(capsys, tmp_path, two, config, case):
    mutate, fragment = SGLANG_CASES[case]
    responses = sglang_responses(two)
    mutate(responses[1])
    source = tmp_path / "s.jsonl"
    write_jsonl(source, responses)
    err = run_import(capsys, tmp_path, "sglang", source, "--model-config", config)
    assert f"{source}: response 1: " in err and fragment in err, err


CONFIG_CASES = {
    "num_hidden_layers 10**12": ({"num_hidden_layers": 10**12}, "num_hidden_layers must be an integer from 1"),
    "decoder_sparse_step '2'": ({"decoder_sparse_step": "2"}, "decoder_sparse_step must be an integer"),
    "mlp_only_layers 3": ({"mlp_only_layers": 3}, "mlp_only_layers must be a list"),
    "a list as torch_dtype": ({"torch_dtype": ["bfloat16"]}, "torch_dtype must be a type name"),
    "a string moe_layer_freq": ({"first_k_dense_replace": 1, "moe_layer_freq": "1"},
                                "moe_layer_freq must be an integer"),
    "experts past the bound": ({"num_local_experts": 2**30}, "num_local_experts must be an integer"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_hostile_model_configs(capsys, tmp_path, two, case):
    changes, fragment = CONFIG_CASES[case]
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**model_config(two), **changes}))
    write_jsonl(tmp_path / "s.jsonl", sglang_responses(two))
    err = run_import(capsys, tmp_path, "sglang", tmp_path / "s.jsonl", "--model-config", path)
    assert str(path) in err and fragment in err, err


def test_a_96_tib_npy_file_and_npz_member_are_refused_before_allocation(capsys, tmp_path):
    (tmp_path / "a.npy").write_bytes(huge_npy())
    assert "--max-array-bytes" in run_import(capsys, tmp_path, "npy", tmp_path / "a.npy", "--experts", 8)
    import zipfile
    with zipfile.ZipFile(tmp_path / "a.npz", "w") as archive:
        archive.writestr("routed_experts.npy", huge_npy())
    assert "--max-array-bytes" in run_import(capsys, tmp_path, "vllm", tmp_path / "a.npz", "--experts", 8)


def test_a_header_larger_than_its_data_is_refused_even_under_the_limit(capsys, tmp_path):
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<i4", "fortran_order": False, "shape": (1000, 8, 2)})
    (tmp_path / "a.npy").write_bytes(buffer.getvalue() + bytes(64))
    assert "64 bytes follow it" in run_import(capsys, tmp_path, "npy", tmp_path / "a.npy", "--experts", 8)


def test_the_array_limit_can_be_raised_and_lowered(capsys, tmp_path, two):
    source = tmp_path / "v.jsonl"
    write_jsonl(source, vllm_responses(two, encoding="npy"))
    err = run_import(capsys, tmp_path, "vllm", source, "--experts", 8, "--max-array-bytes", "1KiB")
    assert "more than the 1,024 an import decodes" in err
    assert main(["trace", "import", "vllm", str(source), "--experts", "8", "--max-array-bytes", "1GiB", "-o",
                 str(tmp_path / "ok.parquet")]) == 0


def test_an_error_quotes_at_most_a_few_hundred_bytes(capsys, tmp_path, two):
    source = tmp_path / "v.jsonl"
    write_jsonl(source, vllm_with(two, lambda r: r["choices"][0].__setitem__("routed_experts", 7 * 10**4000)))
    err = run_import(capsys, tmp_path, "vllm", source, "--experts", 8)
    assert "not int" in err
