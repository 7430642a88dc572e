"""Issue 23, outside the server: inputs that commands misread, ate or crashed on. Every bad input ends in
one line naming the file or field and the problem, exit status 2, before any work and with nothing written."""

from __future__ import annotations

import numpy as np
import pytest

from moe_offload.cli.main import main
from moe_offload.errors import TraceError
from moe_offload.trace.format import DECODE, PREFILL, Trace, TraceMeta


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse's errors
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(code: int, err: str, *fragments) -> None:
    assert code == 2, err
    assert err.startswith("moe-offload") and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert str(fragment) in err, err


# ------------------------------------------------------------------ traces with impossible content

META = TraceMeta(model="m", num_layers=1, num_experts=4, top_k=1, expert_bytes=64)


def build(request, position, phase, iteration) -> Trace:
    return Trace.build(META, np.zeros((len(request), 1, 1), np.int64), request=request, position=position,
                       phase=phase, iteration=iteration)


def test_a_request_decoding_before_its_prompt_with_falling_positions_is_refused():
    # request 0: decode at position 5, then its prompt at positions 1 and 0
    with pytest.raises(TraceError, match="row 1: request 0 has position 1 after position 5"):
        build([0, 0, 0], [5, 1, 0], [DECODE, PREFILL, PREFILL], [0, 1, 1])


def test_a_prefill_after_a_decode_of_the_same_request_is_refused():
    with pytest.raises(TraceError, match="row 2: request 0 has a prefill row after its decode row 1"):
        build([0, 0, 0], [0, 1, 2], [PREFILL, DECODE, PREFILL], [0, 1, 2])


def test_twenty_decode_tokens_of_one_request_in_one_iteration_are_refused():
    with pytest.raises(TraceError, match="row 1: request 0 decodes more than one token in iteration 0"):
        build([0] * 20, list(range(20)), [DECODE] * 20, [0] * 20)


def test_possible_traces_still_pass():
    """A chunked prompt (many prefill rows in one iteration), interleaved requests, one decode per request
    per iteration: all a real scheduler does."""
    trace = build([0, 0, 1, 0, 1, 0, 1], [0, 1, 0, 2, 1, 3, 2],
                  [PREFILL, PREFILL, PREFILL, DECODE, DECODE, DECODE, DECODE], [0, 0, 0, 1, 1, 2, 2])
    assert trace.num_tokens == 7


def test_a_sealed_trace_of_zero_rows_is_refused_in_one_line(tmp_path, capsys):
    import json

    import pyarrow.parquet as pq

    from moe_offload.trace import integrity
    from moe_offload.trace.format import METADATA_KEY, _stored_columns, write_trace

    path = write_trace(build([0, 0], [0, 1], [DECODE, DECODE], [0, 1]), tmp_path / "t.parquet")
    table = pq.read_table(path).slice(0, 0)
    stored = dict(table.schema.metadata)
    empty = {name: values[:0] for name, values in _stored_columns(build([0], [0], [DECODE], [0])).items()}
    stored[integrity.CHECKSUM_KEY] = integrity.seal(json.loads(stored[METADATA_KEY]), empty)
    pq.write_table(table.replace_schema_metadata(stored), path)
    code, _, err = run(capsys, "trace", "info", path)
    assert_refused(code, err, path, "no tokens")


def test_a_layer_key_that_is_a_digit_but_not_a_number_is_refused(tmp_path, capsys):
    import json

    document = {"meta": {"model": "m", "num_experts": 4, "top_k": 1},
                "routes": [{"token_pos": 0, "phase": "decode", "layers": {"²": {"experts": [1], "weights": [1.0]}}}]}
    source = tmp_path / "routes.json"
    source.write_text(json.dumps(document))
    code, _, err = run(capsys, "trace", "import", "routes-json", source, "-o", tmp_path / "out.parquet")
    assert_refused(code, err, source, "layer keys must be layer numbers")
    assert not (tmp_path / "out.parquet").exists()


# ------------------------------------------------------------------ standard output that cannot be written

@pytest.mark.parametrize("argv", [("trace", "info", "olmoe"), ("policies",),
                                  ("simulate", "olmoe", "--policy", "lru", "--cache-size", "64")])
def test_stdout_on_a_full_disk_is_one_line(argv):
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "moe_offload.cli.main", *argv], stdout=full,
                                stderr=subprocess.PIPE, text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr == "moe-offload: error: standard output: cannot write: No space left on device\n"


def test_an_output_name_that_is_not_utf8_is_written(tmp_path, capsys):
    import os

    name = os.fsdecode(b"trace-\xff.parquet")  # what Python makes of such a name on the command line
    code, out, err = run(capsys, "trace", "synth", "zipf", "--length", "50", "-o", tmp_path / name)
    assert code == 0, err
    assert os.listdir(tmp_path) == [name]
    assert "trace-\\udcff.parquet" in out
