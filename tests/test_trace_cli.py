"""`moe-offload trace info|import|synth|flatten`, run in-process."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from moe_offload.bundled import DEFAULT_TRACE
from moe_offload.cli.main import main
from moe_offload.trace.flatten import NEVER, ORACLE_GENERAL_RECORD, flatten
from moe_offload.trace.format import read_trace, write_trace
from moe_offload.trace.synthetic import cyclic_trace, fixed_partition_trace, zipf_trace


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["trace", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, *fragments) -> None:
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("moe-offload: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


# --------------------------------------------------------------------------------------------------- info

def test_info_on_the_bundled_trace(capsys):
    code, out, _ = run(capsys, "info", DEFAULT_TRACE)
    assert code == 0
    for fragment in ("allenai/OLMoE-1B-7B-0924", "16 layers x 64 experts", "top-8", "12,582,912",
                     "299 (prefill 0, decode 299)", "Apache-2.0", "sqliteai/warp", "absent: weights, probs",
                     "reselects", str(DEFAULT_TRACE)):
        assert fragment in out, out


def test_info_json(capsys, tmp_path):
    trace = zipf_trace(num_layers=3, num_experts=4, top_k=2, length=50, a=1.0, b=0.0, seed=0)
    path = write_trace(trace, tmp_path / "z.parquet")
    code, out, _ = run(capsys, "info", path, "--json")
    assert code == 0
    summary = json.loads(out)
    assert (summary["num_layers"], summary["num_experts"], summary["top_k"]) == (3, 4, 2)
    assert summary["tokens"] == 50 and summary["requests"] == 1 and summary["iterations"] == 50
    assert summary["decode_tokens"] == 50 and summary["prefill_tokens"] == 0
    assert summary["columns"] == {"weights": False, "probs": False, "embedding": False, "gate_prediction": False,
                                  "next_token_gate_prediction": False}
    assert summary["embedding_kind"] is None
    assert summary["file_bytes"] == path.stat().st_size
    routing = summary["routing"]
    assert len(routing["top_expert_token_share"]) == 3
    # Independent count: the share of tokens selecting each layer's most used expert.
    for layer, share in enumerate(routing["top_expert_token_share"]):
        counts = np.bincount(trace.experts[:, layer].ravel(), minlength=4)
        assert share == pytest.approx(counts.max() / 50, abs=1e-4)
    # Independent reuse: |S_t,l & S_t+1,l| / K averaged over consecutive tokens and layers.
    shared = [len(set(trace.experts[t, l]) & set(trace.experts[t + 1, l])) for t in range(49) for l in range(3)]
    assert routing["next_token_reuse"] == pytest.approx(np.mean(shared) / 2, abs=1e-4)


def test_info_reports_weights_of_an_imported_trace(capsys, tmp_path, shared_traces):
    output = tmp_path / "qwen.parquet"
    source = shared_traces / "qwen1.5-moe-a2.7b" / "ml_moe_3.json"
    assert run(capsys, "import", "routes-json", source, "-o", output)[0] == 0
    code, out, _ = run(capsys, "info", output, "--json")
    summary = json.loads(out)
    assert summary["columns"]["weights"] is True
    document = json.loads(source.read_text())
    assert summary["prefill_tokens"] == len(document["prompt_tokens"])
    assert summary["iterations"] == 1 + len(document["generated_tokens"])


# ------------------------------------------------------------------------------------------------- import

def test_import_topk_jsonl(capsys, tmp_path, olmoe_file):
    source = olmoe_file
    output = tmp_path / "olmoe.parquet"
    code, out, _ = run(capsys, "import", "topk-jsonl", source, "-o", output, "--experts", 64,
                       "--model", "allenai/OLMoE-1B-7B-0924", "--expert-bytes", 12582912)
    assert code == 0 and str(output) in out
    trace = read_trace(output)
    assert trace.num_tokens == 299 and trace.meta.expert_bytes == 12582912
    np.testing.assert_array_equal(trace.experts, read_trace(DEFAULT_TRACE).experts)


def test_import_topk_jsonl_without_experts_is_a_clear_error(capsys, tmp_path, olmoe_file):
    source = olmoe_file
    code, _, err = run(capsys, "import", "topk-jsonl", source, "-o", tmp_path / "x.parquet")
    assert_one_line_error(code, err, str(source), "--experts", "63")
    assert not (tmp_path / "x.parquet").exists()


def test_import_topk_jsonl_as_requests_with_prompts(capsys, tmp_path, shared_traces):
    source = shared_traces / "granite-3.0-1b-a400m" / "sglang_8_requests.jsonl"
    output = tmp_path / "granite.parquet"
    code, out, _ = run(capsys, "import", "topk-jsonl", source, "-o", output, "--experts", 32, "--request-rows", 27,
                       "--prompt-rows", 8)
    assert code == 0 and "216 tokens in 8 request(s)" in out
    assert read_trace(output).num_requests == 8
    code, _, err = run(capsys, "import", "routes-json", source, "-o", tmp_path / "x.parquet", "--prompt-rows", 8)
    assert_one_line_error(code, err, "--prompt-rows is for the formats topk-jsonl, not routes-json")
    code, _, err = run(capsys, "import", "topk-jsonl", source, "-o", tmp_path / "x.parquet", "--experts", 32,
                       "--request-rows", 25)
    assert_one_line_error(code, err, str(source), "216 routing lines are not whole requests of --request-rows 25")
    assert not (tmp_path / "x.parquet").exists()


def test_import_several_routes_files(capsys, tmp_path, shared_traces):
    folder = shared_traces / "qwen1.5-moe-a2.7b"
    output = tmp_path / "two.parquet"
    code, _, _ = run(capsys, "import", "routes-json", folder / "history_1.json", folder / "history_2.json",
                     "-o", output)
    assert code == 0
    assert read_trace(output).num_requests == 2


def test_import_of_a_malformed_file_names_the_line(capsys, tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"tok": 1, "layers": [[0, 1]]}\n{"tok": 2, "layers": [[0, 0]]}\n')
    code, _, err = run(capsys, "import", "topk-jsonl", source, "-o", tmp_path / "x.parquet", "--experts", 4)
    assert_one_line_error(code, err, str(source), "line 2", "twice")


def test_import_unknown_format_is_an_argparse_error(capsys, tmp_path):
    with pytest.raises(SystemExit) as caught:
        main(["trace", "import", "tsv", str(tmp_path / "a"), "-o", str(tmp_path / "b")])
    assert caught.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------------- synth

def test_synth_zipf_matches_the_generator(capsys, tmp_path):
    output = tmp_path / "z.parquet"
    code, _, _ = run(capsys, "synth", "zipf", "--layers", 4, "--experts", 6, "--top-k", 2, "--length", 300,
                     "--a", 1.5, "--b", 0.5, "--seed", 3, "--shuffle", "-o", output)
    assert code == 0
    expected = zipf_trace(4, 6, 2, 300, 1.5, 0.5, 3, shuffle=True)
    np.testing.assert_array_equal(read_trace(output).experts, expected.experts)


def test_synth_cyclic_and_fixed_partition(capsys, tmp_path):
    assert run(capsys, "synth", "cyclic", "--layers", 2, "--cache-size", 5, "--rounds", 12,
               "-o", tmp_path / "c.parquet")[0] == 0
    np.testing.assert_array_equal(read_trace(tmp_path / "c.parquet").experts, cyclic_trace(2, 5, 12).experts)
    assert run(capsys, "synth", "fixed-partition", "--layers", 3, "--experts", 4, "--rounds", 10,
               "--cycling-layer", 1, "-o", tmp_path / "f.parquet")[0] == 0
    np.testing.assert_array_equal(read_trace(tmp_path / "f.parquet").experts,
                                  fixed_partition_trace(3, 4, 10, 1).experts)


def test_synth_with_impossible_parameters(capsys, tmp_path):
    code, _, err = run(capsys, "synth", "cyclic", "--layers", 3, "--cache-size", 7, "-o", tmp_path / "c.parquet")
    assert_one_line_error(code, err, "divide")


# ------------------------------------------------------------------------------------------------ flatten

def read_csv(path: Path) -> list[tuple[int, int, int]]:
    with path.open(newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["time", "id", "size"]
    return [tuple(map(int, r)) for r in rows[1:]]


def test_flatten_order_is_token_rank_layer(capsys, tmp_path):
    L, J, K = 3, 5, 2
    trace = zipf_trace(num_layers=L, num_experts=J, top_k=K, length=20, a=0.5, b=0.0, seed=11)
    source = write_trace(trace, tmp_path / "t.parquet")
    output = tmp_path / "t.csv"
    code, out, _ = run(capsys, "flatten", source, "-o", output)
    assert code == 0 and str(output) in out
    expected = [l * J + int(trace.experts[n, l, r]) for n in range(20) for r in range(K) for l in range(L)]
    rows = read_csv(output)
    assert [row[0] for row in rows] == list(range(len(expected)))
    assert [row[1] for row in rows] == expected
    assert {row[2] for row in rows} == {1}  # no expert size known


def test_flatten_to_libcachesim_oracle_general(capsys, tmp_path):
    trace = zipf_trace(num_layers=3, num_experts=4, top_k=2, length=30, a=1.0, b=0.0, seed=12)
    source = write_trace(trace, tmp_path / "t.parquet")
    output = tmp_path / "t.oracleGeneral.bin"
    assert run(capsys, "flatten", source, "-o", output, "--format", "oracle-general")[0] == 0
    records = np.fromfile(output, dtype=ORACLE_GENERAL_RECORD)
    sequence = flatten(trace)
    np.testing.assert_array_equal(records["obj_id"], sequence.expert_id)
    np.testing.assert_array_equal(records["clock_time"], np.arange(len(sequence)))
    np.testing.assert_array_equal(records["next_access_vtime"],
                                  np.where(sequence.next_use == NEVER, -1, sequence.next_use))


def test_flatten_uses_the_expert_size(capsys, tmp_path):
    output = tmp_path / "olmoe.csv"
    assert run(capsys, "flatten", DEFAULT_TRACE, "-o", output)[0] == 0
    rows = read_csv(output)
    assert len(rows) == 299 * 8 * 16
    assert {row[2] for row in rows} == {3 * 2048 * 1024 * 2}


# ------------------------------------------------------------------------------------------------- errors

def test_info_on_a_missing_file(capsys, tmp_path):
    missing = tmp_path / "absent.parquet"
    code, _, err = run(capsys, "info", missing)
    assert_one_line_error(code, err, str(missing), "no such file")


def test_info_on_a_file_that_is_not_a_trace(capsys, tmp_path):
    path = tmp_path / "notes.parquet"
    path.write_text("hello")
    code, _, err = run(capsys, "info", path)
    assert_one_line_error(code, err, str(path))


def test_flatten_of_a_truncated_trace(capsys, tmp_path):
    path = write_trace(zipf_trace(4, 8, 2, 2000, 1.0, 0.0, 0), tmp_path / "cut.parquet")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    code, _, err = run(capsys, "flatten", path, "-o", tmp_path / "out.csv")
    assert_one_line_error(code, err, str(path))


def test_writing_into_an_unwritable_place(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    output = blocker / "trace.parquet"
    code, _, err = run(capsys, "synth", "zipf", "--length", 10, "-o", output)
    assert_one_line_error(code, err, str(output), "cannot be created (a file is in the way)")
