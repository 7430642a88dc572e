"""Property: any JSON value in any field an importer reads gives a valid trace or the one-line error, never a
traceback (issue #33). Each importer's JSON source (vLLM's responses in their two releases, SGLang's
OpenAI and /generate answers, Megatron's RouterTracer lines, the model config) is built small and valid,
then one of its fields (or a whole sub-object) is replaced by a generated JSON value and the file imported
through the command line, in process. Hypothesis runs derandomized with a fixed number of examples."""

from __future__ import annotations

import base64
import contextlib
import io
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_offload.cli.main import main
from moe_offload.trace.format import read_trace

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6) | st.sampled_from(["AAAA", "", "k1NVTVBZ", "-1"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(
        st.sampled_from(["encoding", "dtype", "shape", "data", "prompt_tokens", "routed_experts", "x"]), children,
        max_size=4),
    max_leaves=8)

IDS = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[2, 3], [0, 1]]])  # 3 tokens, 2 layers, top-2, J = 4
CONFIG = {"model_type": "mixtral", "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
          "hidden_size": 4, "intermediate_size": 8, "torch_dtype": "float32"}


def npy_text(array) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def sources() -> dict:
    """format -> (valid JSON document list, file suffix)."""
    raw = base64.b64encode(IDS.astype("<i4").tobytes()).decode()
    usage = {"prompt_tokens": 2, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}}
    return {
        "vllm": [{"model": "m", "created": 1, "choices": [{"index": 0, "routed_experts": npy_text(IDS.astype(np.uint8))}],
                  "usage": usage},
                 {"model": "m", "prompt_routed_experts": IDS[:2].tolist(),
                  "choices": [{"index": 0, "routed_experts": IDS[2:].tolist()}],
                  "usage": {"prompt_tokens": 2, "completion_tokens": 2}}],
        "sglang": [{"model": "m", "choices": [{"sgl_ext": {"routed_experts": raw}}], "usage": usage},
                   {"text": "x", "meta_info": {"routed_experts": raw, "prompt_tokens": 2, "completion_tokens": 2,
                                               "cached_tokens": 0}}],
        "megatron": [{"step": 0, "block": "decoder", "layer": layer + 1, "rank": 0, "num_tokens": 3, "topk": 2,
                      "top_indices": IDS[:, layer].tolist()} for layer in range(2)],
    }


def paths_of(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from paths_of(child, prefix + (key,))
    elif isinstance(value, list) and len(prefix) < 4:  # the ids' inner lists are fuzzed as a whole
        for index, child in enumerate(value):
            yield from paths_of(child, prefix + (index,))


def invoke(*argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exit_:
            code = exit_.code
    return code, err.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("importer-fuzz")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


def check(folder, code: int, err: str, output, *names) -> None:
    if code == 0:
        read_trace(output)  # what was written reads back, sealed and valid
        output.unlink()
        return
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and err.startswith("moe-offload") and "Traceback" not in err, err
    assert len(err) < 1000, err
    assert any(str(name) in err for name in names), err
    assert not output.exists()


def fuzz(examples: int):
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))


@fuzz(120)
@given(fmt=st.sampled_from(["vllm", "sglang", "megatron"]), choice=st.floats(0, 1, exclude_max=True),
       value=json_values)
def test_any_json_value_in_any_field_is_imported_or_refused_in_one_line(folder, fmt, choice, value):
    documents = sources()[fmt]
    locations = [path for path in paths_of(documents) if path]
    *parents, last = locations[int(choice * len(locations))]
    holder = documents
    for key in parents:
        holder = holder[key]
    holder[last] = value
    source = folder / f"{fmt}.jsonl"
    source.write_text("".join(json.dumps(d) + "\n" for d in documents))
    output = folder / "out.parquet"
    code, err = invoke("trace", "import", fmt, source, "--model-config", folder / "config.json", "-o", output)
    check(folder, code, err, output, source)


@fuzz(60)
@given(field=st.sampled_from(sorted(CONFIG) + ["first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step",
                                                "mlp_only_layers", "n_routed_experts", "dtype"]), value=json_values)
def test_any_json_value_in_a_model_config_is_used_or_refused_in_one_line(folder, field, value):
    config = folder / "fuzzed-config.json"
    config.write_text(json.dumps({**CONFIG, field: value}))
    source = folder / "s.jsonl"
    source.write_text("".join(json.dumps(d) + "\n" for d in sources()["sglang"]))
    output = folder / "out.parquet"
    code, err = invoke("trace", "import", "sglang", source, "--model-config", config, "-o", output)
    check(folder, code, err, output, config, source)
