"""The Parquet trace format: round trips, compact types, and a TraceError for every kind of bad file."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_offload.errors import TraceError
from moe_offload.trace.format import DECODE, METADATA_KEY, PREFILL, Trace, TraceMeta, read_trace, write_trace
from moe_offload.trace.parquet_columns import expert_dtype
from moe_offload.trace.synthetic import zipf_trace


def full_trace(num_layers=3, num_experts=5, top_k=2, tokens=7, embedding_size=4, seed=0) -> Trace:
    """A trace with every optional column: two requests, a prefill iteration followed by decode tokens."""
    rng = np.random.default_rng(seed)
    experts = np.stack([np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_layers)])
                        for _ in range(tokens)])
    logits = rng.normal(size=(tokens, num_layers, num_experts))
    probs = np.exp(logits) / np.exp(logits).sum(axis=2, keepdims=True)
    gate_logits = rng.normal(size=(tokens, num_layers - 1, num_experts))
    gate_prediction = np.exp(gate_logits) / np.exp(gate_logits).sum(axis=2, keepdims=True)
    first_logits = rng.normal(size=(tokens, num_experts))
    next_token = np.exp(first_logits) / np.exp(first_logits).sum(axis=1, keepdims=True)
    split = tokens // 2
    meta = TraceMeta(model="test-model", num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                     expert_bytes=1234, hidden_size=16, source="unit test", license="CC0-1.0",
                     extra={"note": "round trip", "nested": {"list": [1, 2]}})
    return Trace.build(
        meta, experts,
        request=[0] * split + [1] * (tokens - split),
        position=list(range(split)) + list(range(tokens - split)),
        phase=[PREFILL, PREFILL] + [DECODE] * (split - 2) + [PREFILL] + [DECODE] * (tokens - split - 1),
        iteration=[0, 0] + list(range(1, split - 1)) + [split - 1] + list(range(split, split + tokens - split - 1)),
        weights=np.take_along_axis(probs, experts, axis=2), probs=probs,
        embedding=rng.normal(size=(tokens, embedding_size)), gate_prediction=gate_prediction,
        next_token_gate_prediction=next_token)


def assert_same_trace(got: Trace, expected: Trace) -> None:
    assert got.meta == expected.meta
    for name in ("request", "position", "phase", "iteration", "experts", "weights", "probs", "embedding",
                 "gate_prediction", "next_token_gate_prediction"):
        expected_values, got_values = getattr(expected, name), getattr(got, name)
        if expected_values is None:
            assert got_values is None, name
        else:
            np.testing.assert_array_equal(got_values, expected_values, err_msg=name)
            assert got_values.dtype == expected_values.dtype, name


# ---------------------------------------------------------------------------------------------- round trips

def test_every_column_survives_a_round_trip(tmp_path):
    trace = full_trace()
    path = write_trace(trace, tmp_path / "full.parquet")
    got = read_trace(path)
    assert_same_trace(got, trace)
    assert got.experts.dtype == np.uint8
    for name in ("weights", "probs", "embedding", "gate_prediction"):
        assert getattr(got, name).dtype == np.float16
    assert got.meta.extra == {"note": "round trip", "nested": {"list": [1, 2]}}
    assert got.path == str(path)


def test_parquet_schema_uses_compact_types(tmp_path):
    trace = full_trace(num_layers=3, num_experts=5, top_k=2, embedding_size=4)
    schema = pq.read_schema(write_trace(trace, tmp_path / "t.parquet"))
    assert schema.field("request").type == pa.int32()
    assert schema.field("position").type == pa.int32()
    assert schema.field("iteration").type == pa.int32()
    assert pa.types.is_dictionary(schema.field("phase").type)
    assert schema.field("experts").type == pa.list_(pa.uint8(), 3 * 2)
    assert schema.field("weights").type == pa.list_(pa.float16(), 3 * 2)
    assert schema.field("probs").type == pa.list_(pa.float16(), 3 * 5)
    assert schema.field("embedding").type == pa.list_(pa.float16(), 4)
    assert schema.field("gate_prediction").type == pa.list_(pa.float16(), 2 * 5)
    assert schema.field("next_token_gate_prediction").type == pa.list_(pa.float16(), 5)
    meta = json.loads(schema.metadata[METADATA_KEY])
    assert meta["format_version"] == 2 and meta["embedding_kind"] == "token"


def test_a_version_1_embedding_is_read_as_the_prompt_mean_and_never_as_per_token(tmp_path):
    # Files written before embedding_kind existed hold the request's prompt mean on every row and said so only
    # in prose: reading one must mark it, so that fMoE (which needs each token's embedding) refuses it instead of using it.
    from moe_offload.errors import ConfigError
    from moe_offload.prefetch import check_trace_columns, prefetcher_info

    trace = full_trace()
    path = write_trace(trace, tmp_path / "v2.parquet")
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[METADATA_KEY])
    meta["format_version"] = 1
    del meta["embedding_kind"]
    old = tmp_path / "v1.parquet"
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), old)
    got = read_trace(old, unsealed=True)
    assert got.meta.embedding_kind == "request-prompt-mean"
    np.testing.assert_array_equal(got.embedding, trace.embedding)  # the column itself reads unchanged
    check_trace_columns(prefetcher_info("fmoe"), read_trace(path))
    with pytest.raises(ConfigError, match=r"v1\.parquet.*'embedding'.*format version 1.*record it again"):
        check_trace_columns(prefetcher_info("fmoe"), got)
    meta["embedding_kind"] = "sentence"
    bad = tmp_path / "bad.parquet"
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), bad)
    with pytest.raises(TraceError, match="embedding_kind must be one of token, request-prompt-mean, not 'sentence'"):
        read_trace(bad, unsealed=True)


@pytest.mark.parametrize("num_experts, dtype", [(1, np.uint8), (256, np.uint8), (257, np.uint16),
                                                (65536, np.uint16), (65537, np.uint32)])
def test_expert_ids_use_the_smallest_unsigned_type(num_experts, dtype):
    assert expert_dtype(num_experts) == dtype


def test_many_experts_are_stored_as_uint16(tmp_path):
    meta = TraceMeta(model="wide", num_layers=2, num_experts=300, top_k=2)
    trace = Trace.build(meta, [[[0, 299], [298, 1]], [[150, 151], [7, 8]]])
    path = write_trace(trace, tmp_path / "wide.parquet")
    assert pq.read_schema(path).field("experts").type == pa.list_(pa.uint16(), 4)
    got = read_trace(path)
    assert got.experts.dtype == np.uint16
    np.testing.assert_array_equal(got.experts, trace.experts)


def test_reading_selected_optional_columns(tmp_path):
    path = write_trace(full_trace(), tmp_path / "t.parquet")
    got = read_trace(path, columns=("weights",))
    assert got.weights is not None
    assert got.probs is None and got.embedding is None and got.gate_prediction is None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_layers=st.integers(2, 5), num_experts=st.integers(2, 9), tokens=st.integers(1, 12),
       top_k_fraction=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_round_trip_property(tmp_path, num_layers, num_experts, tokens, top_k_fraction, seed):
    top_k = 1 + int(top_k_fraction * (num_experts - 1))
    trace = full_trace(num_layers, num_experts, top_k, tokens=max(tokens, 4), seed=seed)
    assert_same_trace(read_trace(write_trace(trace, tmp_path / f"p{seed}.parquet")), trace)


def test_a_million_token_trace_stays_small(tmp_path):
    # Information theory sets the floor: i.i.d. uniform routing of 32 layers x 8 experts, top-2, carries
    # log2(56) bits per token and layer, 23.2 MB for a million tokens, so the trace is drawn with the skew of
    # paper 001's Figure 6a (Zipf parameter 2), whose entropy is 14.4 MB.
    trace = zipf_trace(num_layers=32, num_experts=8, top_k=2, length=1_000_000, a=2.0, b=0.0, seed=0)
    path = write_trace(trace, tmp_path / "million.parquet")
    size = path.stat().st_size
    assert size < 20_000_000, f"{size / 1e6:.1f} MB"


# ------------------------------------------------------------------------------------------- malformed files

def write_raw(path, experts_per_row: np.ndarray, meta, *, phase=None, iteration=None, list_size=None):
    """Write a Parquet file by hand, bypassing write_trace's validation. ``meta`` is a dict (JSON-encoded),
    raw bytes, or None for no trace metadata at all. The file has no checksum (format 1): the tests read it
    with ``unsealed=True``, as `trace seal` does, to reach the checks behind the checksum's."""
    n = len(experts_per_row)
    flat = np.asarray(experts_per_row, dtype=np.uint8).reshape(n, -1)
    if list_size is None:
        experts = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1), pa.uint8()), flat.shape[1])
    else:  # a variable-length list column: rows may differ in length
        experts = pa.array([list(map(int, row))[:size] for row, size in zip(flat, list_size)],
                           pa.list_(pa.uint8()))
    table = pa.table({
        "request": pa.array(np.zeros(n, np.int32)),
        "position": pa.array(np.arange(n, dtype=np.int32)),
        "phase": pa.array(phase or ["decode"] * n).dictionary_encode(),
        "iteration": pa.array(np.arange(n, dtype=np.int32) if iteration is None else np.asarray(iteration, np.int32)),
        "experts": experts,
    })
    if meta is not None:
        raw = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
        table = table.replace_schema_metadata({METADATA_KEY: raw})
    pq.write_table(table, path)
    return path


def meta_dict(**changes) -> dict:
    meta = {"format_version": 1, "model": "m", "num_layers": 2, "num_experts": 8, "top_k": 2}
    meta.update(changes)
    return meta


def good_rows(tokens=6) -> np.ndarray:
    """[tokens, L*K] rows of distinct pairs for L=2, J=8, K=2."""
    return np.array([[t % 8, (t + 1) % 8, (t + 2) % 8, (t + 3) % 8] for t in range(tokens)])


def expect_trace_error(path, *fragments) -> TraceError:
    with pytest.raises(TraceError) as caught:
        read_trace(path, unsealed=True)
    message = str(caught.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return caught.value


def test_the_hand_written_file_is_valid(tmp_path):
    trace = read_trace(write_raw(tmp_path / "ok.parquet", good_rows(), meta_dict()), unsealed=True)
    assert trace.experts.shape == (6, 2, 2)


def test_missing_file(tmp_path):
    expect_trace_error(tmp_path / "absent.parquet", "no such file")


def test_directory_instead_of_file(tmp_path):
    expect_trace_error(tmp_path, "directory")


def test_not_a_parquet_file(tmp_path):
    path = tmp_path / "text.parquet"
    path.write_text("not a trace\n")
    expect_trace_error(path, "not a Parquet file")


@pytest.mark.parametrize("name, head, hint", [
    ("routing.csv", b"request,token,layer,expert\n0,0,0,1\n", "but CSV: convert it with `moe-offload trace import "
                                                             "FORMAT {path} -o TRACE.parquet` (FORMAT csv or llamacpp"),
    ("decode 299.jsonl", b'{"tok": 0, "layers": [[1, 2]]}\n', "but JSON: convert it with `moe-offload trace import "
                                                            "topk-jsonl '{path}' --experts J -o TRACE.parquet` (J: "),
    ("list.json", b'\xef\xbb\xbf\n  [{"meta": 1}]', "but JSON: convert it with `moe-offload trace import FORMAT "
                                                  "{path} -o TRACE.parquet` (FORMAT sglang, vllm, megatron, routes-json or topk-jsonl; "),
    ("routes.json", b'{"meta": {"num_experts": 4}, "routes": []}',
     "but JSON: convert it with `moe-offload trace import routes-json {path} -o TRACE.parquet`"),
    ("vllm.jsonl", b'{"id": "c", "choices": [{"text": "a", "routed_experts" : "k05VTVBZ"}]}\n',
     "but JSON: convert it with `moe-offload trace import vllm {path} --experts J -o TRACE.parquet`"),
    # an SGLang response names routed_experts too, under its own extension
    ("sglang.json", b'[{"choices": [{"sgl_ext": {"routed_experts": "AAAA"}}]}]',
     "but JSON: convert it with `moe-offload trace import sglang {path} --model-config config.json -o "
     "TRACE.parquet` (config.json: "),
    ("rank0.jsonl", b'{"step": 0, "block": "decoder", "layer": 1, "rank": 0, "top_indices": [[1, 2]]}\n',
     "but JSON: convert it with `moe-offload trace import megatron {path} --experts J -o TRACE.parquet`"),
    ("routing.npy", b"\x93NUMPY\x01\x00", "but a NumPy array file: convert it with `moe-offload trace import FORMAT"),
    ("model.gguf", b"GGUF\x03\x00\x00\x00", "but a GGUF model file: a routing trace is recorded or imported"),
])
def test_a_foreign_file_is_named_with_its_import_command(tmp_path, name, head, hint):
    path = tmp_path / name
    path.write_bytes(head)
    expect_trace_error(path, "not a trace of this project " + hint.format(path=path))


def test_the_import_command_a_foreign_file_is_named_with_runs_as_printed(tmp_path, capsys, olmoe_file, qwen_folder):
    from cli_driver import run

    from moe_offload.trace.counts import read_counts

    for source, read, experts in ((olmoe_file, read_trace, "64"), (qwen_folder / "cooking_1.json", read_counts, "60")):
        with pytest.raises(TraceError) as caught:
            read(source)
        command = str(caught.value).split("`")[1].replace(" J ", f" {experts} ")
        output = tmp_path / f"{source.stem}.parquet"
        code, _, err = run(capsys, *shlex.split(command)[1:-1], output)
        assert code == 0, err
        assert read_trace(output).num_tokens > 0


def test_truncated_parquet_file(tmp_path):
    path = write_trace(full_trace(tokens=50), tmp_path / "cut.parquet")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    expect_trace_error(path)


def test_parquet_without_trace_metadata(tmp_path):
    expect_trace_error(write_raw(tmp_path / "foreign.parquet", good_rows(), None), "trace import")


def test_expert_id_out_of_range_names_the_row(tmp_path):
    rows = good_rows()
    rows[4, 3] = 8  # layer 1 of row 4 selects expert 8 of 0..7
    error = expect_trace_error(write_raw(tmp_path / "range.parquet", rows, meta_dict()), "row 4", "layer 1")
    assert error.row == 4


def test_duplicated_expert_names_the_row(tmp_path):
    rows = good_rows()
    rows[3, 0:2] = [5, 5]  # layer 0 of row 3 selects expert 5 twice
    error = expect_trace_error(write_raw(tmp_path / "dup.parquet", rows, meta_dict()), "row 3", "twice")
    assert error.row == 3


def test_metadata_with_more_layers_than_the_rows(tmp_path):
    # 2 layers x 2 experts per row, but the metadata claims 3 layers.
    expect_trace_error(write_raw(tmp_path / "layers.parquet", good_rows(), meta_dict(num_layers=3)),
                       "values per row")


def test_a_row_with_a_different_number_of_layers(tmp_path):
    # A variable-length list in which row 2 holds one layer (2 ids) instead of two (4 ids).
    sizes = [4, 4, 2, 4, 4, 4]
    path = write_raw(tmp_path / "ragged.parquet", good_rows(), meta_dict(), list_size=sizes)
    expect_trace_error(path, "experts")


def test_top_k_mismatch_between_metadata_and_rows(tmp_path):
    expect_trace_error(write_raw(tmp_path / "k.parquet", good_rows(), meta_dict(num_layers=1, top_k=3)),
                       "values per row")


def test_top_k_mismatch_in_memory():
    meta = TraceMeta(model="m", num_layers=2, num_experts=8, top_k=3)
    with pytest.raises(TraceError, match="top_k=3"):
        Trace.build(meta, good_rows().reshape(6, 2, 2))


@pytest.mark.parametrize("meta, fragment", [
    (b"{not json", "invalid JSON"),
    (meta_dict(num_experts=None), "num_experts"),
    ({k: v for k, v in meta_dict().items() if k != "top_k"}, "lacks top_k"),
    (meta_dict(top_k=9), "exceeds num_experts"),
    (meta_dict(num_layers=0), "num_layers"),
    (meta_dict(format_version=99), "version 99"),
    (meta_dict(expert_bytes=-5), "expert_bytes"),
    (b"[1, 2]", "metadata"),
    (meta_dict(extra="not an object"), "extra"),
])
def test_bad_metadata(tmp_path, meta, fragment):
    expect_trace_error(write_raw(tmp_path / "meta.parquet", good_rows(), meta), fragment)


def test_unknown_phase_names_the_row(tmp_path):
    phase = ["decode"] * 6
    phase[2] = "warmup"
    path = write_raw(tmp_path / "phase.parquet", good_rows(), meta_dict(), phase=phase)
    expect_trace_error(path, "row 2", "warmup")


def test_rows_out_of_iteration_order_name_the_row(tmp_path):
    path = write_raw(tmp_path / "order.parquet", good_rows(), meta_dict(), iteration=[0, 1, 2, 1, 4, 5])
    expect_trace_error(path, "row 3", "iteration order")


def test_a_trace_read_a_row_at_a_time_is_the_trace(tmp_path, monkeypatch):
    from moe_offload.trace import parquet_columns

    monkeypatch.setattr(parquet_columns, "READ_VALUES", 1)  # a row a piece
    monkeypatch.setattr(parquet_columns, "ROW_GROUP_REQUESTS", 12)  # two rows of 3 layers x top-2 a row group
    trace = full_trace(tokens=11)
    path = write_trace(trace, tmp_path / "groups.parquet")
    assert pq.ParquetFile(path).metadata.num_row_groups == 6
    assert_same_trace(read_trace(path), trace)


def test_a_problem_in_a_later_piece_names_its_row_in_the_file(tmp_path, monkeypatch):
    from moe_offload.trace import parquet_columns

    monkeypatch.setattr(parquet_columns, "READ_VALUES", 1)  # a row a piece
    phase = ["decode"] * 6
    phase[5] = "warmup"  # in the sixth piece
    error = expect_trace_error(write_raw(tmp_path / "phase.parquet", good_rows(), meta_dict(), phase=phase),
                               "row 5", "warmup")
    assert error.row == 5
