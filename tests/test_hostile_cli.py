"""Issue 23, outside the server: inputs that commands misread, ate or crashed on. Every bad input ends in
one line naming the file or field and the problem, exit status 2, before any work and with nothing written."""

from __future__ import annotations

import numpy as np
import pytest

from moe_offload.errors import TraceError
from moe_offload.trace.format import DECODE, PREFILL, Trace, TraceMeta
from cli_driver import assert_refused, run  # noqa: E402


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
    from moe_offload.trace.format import METADATA_KEY, write_trace
    from moe_offload.trace.parquet_columns import stored_columns

    path = write_trace(build([0, 0], [0, 1], [DECODE, DECODE], [0, 1]), tmp_path / "t.parquet")
    table = pq.read_table(path).slice(0, 0)
    stored = dict(table.schema.metadata)
    empty = {name: values[:0] for name, values in stored_columns(build([0], [0], [DECODE], [0])).items()}
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


# ------------------------------------------------------------------ sweep results: locked, sealed, checked

SMALL_SWEEP = """
traces = ["zipf.parquet"]
policies = ["lru", "lfu"]
cache_sizes = [3]
output = "results.parquet"
"""


@pytest.fixture
def small_sweep(tmp_path):
    from moe_offload.trace.format import write_trace
    from moe_offload.trace.synthetic import zipf_trace

    write_trace(zipf_trace(num_layers=2, num_experts=6, top_k=2, length=30, a=1.0, b=1.0, seed=1),
                tmp_path / "zipf.parquet")
    (tmp_path / "sweep.toml").write_text(SMALL_SWEEP)
    return tmp_path / "sweep.toml"


def test_a_second_sweep_into_the_same_results_is_refused_while_the_first_runs(small_sweep, capsys):
    from moe_offload.sweep.store import ResultStore

    results = small_sweep.parent / "results.parquet"
    with ResultStore(results, []):  # the first sweep, running
        code, _, err = run(capsys, "sweep", small_sweep)
        assert_refused(code, err, results, "another sweep is writing these results now")
        assert not results.exists()
    code, _, err = run(capsys, "sweep", small_sweep)  # once it is done
    assert code == 0, err


def rewrite_metadata(path, change) -> None:
    import pyarrow.parquet as pq

    from moe_offload.sweep.store import METADATA_KEY

    table = pq.read_table(path)
    stored = dict(table.schema.metadata)
    stored[METADATA_KEY] = change(stored[METADATA_KEY])
    pq.write_table(table.replace_schema_metadata(stored), path)


@pytest.mark.parametrize("metadata, problem", [
    (b"[1, 2]", "metadata must be a JSON object, not list"),
    (b'"a string"', "metadata must be a JSON object, not str"),
    (b"[" * 100_000 + b"]" * 100_000, "JSON nested too deeply"),
])
def test_sweep_results_whose_metadata_is_not_an_object_are_refused(small_sweep, capsys, metadata, problem):
    assert run(capsys, "sweep", small_sweep)[0] == 0
    results = small_sweep.parent / "results.parquet"
    rewrite_metadata(results, lambda _: metadata)
    before = results.read_bytes()
    code, _, err = run(capsys, "sweep", small_sweep)
    assert_refused(code, err, results, problem)
    assert results.read_bytes() == before


def test_a_changed_value_in_the_sweep_results_is_refused_on_resume(small_sweep, capsys):
    """The issue's case: an access count read back as another number. Here a whole value, rewritten with a
    valid Parquet file around it (what a flipped bit in a page does, without the luck of the page checksum)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert run(capsys, "sweep", small_sweep)[0] == 0
    results = small_sweep.parent / "results.parquet"
    table = pq.read_table(results)
    index = table.column_names.index("accesses")
    changed = pa.array([value * 439 for value in table.column("accesses").to_pylist()], table.schema.field(index).type)
    pq.write_table(table.set_column(index, table.schema.field(index), changed), results)
    code, _, err = run(capsys, "sweep", small_sweep)
    assert_refused(code, err, results, "do not match their checksum")


def test_bit_flips_in_sweep_results_read_back_identical_or_are_refused(small_sweep, capsys, tmp_path):
    """One bit of every 53rd byte of a small results file (bit 0 of byte 0, bit 1 of byte 53, ...): read back
    as the rows written, or refused."""
    from moe_offload.errors import ConfigError
    from moe_offload.sweep.store import read_results

    assert run(capsys, "sweep", small_sweep)[0] == 0
    clean_bytes = (small_sweep.parent / "results.parquet").read_bytes()
    clean = read_results(small_sweep.parent / "results.parquet")
    damaged = tmp_path / "damaged.parquet"
    accepted = refused = 0
    offsets = range(0, len(clean_bytes), 53)
    for offset in offsets:
        data = bytearray(clean_bytes)
        data[offset] ^= 1 << (offset // 53 % 8)
        damaged.write_bytes(bytes(data))
        try:
            rows = read_results(damaged)
        except ConfigError:
            refused += 1
            continue
        assert rows == clean, offset
        accepted += 1
    assert refused > 0 and accepted + refused == len(offsets)


# ------------------------------------------------------------------ sizes checked before the work

@pytest.mark.parametrize("rate", ["1e-15", "1e-12"])
def test_poisson_rates_the_clock_cannot_resolve_are_refused(capsys, rate):
    """At 1e-12 requests/s the one request of the bundled trace arrives near 6.8e11 s, where float64 steps by
    2^-13 s = 0.12 ms (np.spacing): more than the 1e-7 s the simulator accepts."""
    code, _, err = run(capsys, "simulate", "--timed", "olmoe", "--arrivals", f"poisson:{rate}", "--policy", "lru")
    assert_refused(code, err, "olmoe-1b-7b-decode299.parquet", "the simulator's clock steps by", "give arrivals closer")


def test_a_resolvable_poisson_rate_still_runs():
    from moe_offload.simulator.timed.schedule import CLOCK_RESOLUTION, Arrivals

    Arrivals.parse("poisson:1e-6").check_clock(100, "t")  # 1e8 s: a step of 1.5e-8 s
    assert np.spacing(1e8) < CLOCK_RESOLUTION < np.spacing(1e12)


def test_more_experts_than_the_timed_simulator_models_are_refused_at_once(tmp_path, capsys):
    from moe_offload.trace.format import write_trace

    layers = 2**17  # within the metadata's bound (2^24 experts), which replay takes
    meta = TraceMeta(model="deep", num_layers=layers, num_experts=1, top_k=1, expert_bytes=4096)
    path = write_trace(Trace.build(meta, np.zeros((2, layers, 1), np.int64)), tmp_path / "deep.parquet")
    code, _, err = run(capsys, "simulate", "--timed", path, "--policy", "lru", "--jobs", 1)
    assert_refused(code, err, path, "131,072 layers x 1 experts is more experts than the timed simulator models")


def test_a_history_whose_eams_exceed_memory_is_refused_before_allocating(tmp_path, monkeypatch):
    """256 layers x 4,096 experts for 1,000 requests: 3 x 1,000 x 2^20 x 8 bytes = 23.4 GiB of EAM arrays
    against the 1 GiB this test says is available."""
    from moe_offload import inputs
    from moe_offload.errors import ConfigError
    from moe_offload.prefetch.eam import sequence_eams

    layers, experts, requests = 256, 4096, 1000
    meta = TraceMeta(model="big", num_layers=layers, num_experts=experts, top_k=1, expert_bytes=4096)
    rng = np.random.default_rng(0)
    history = Trace.build(meta, rng.integers(0, experts, (requests, layers, 1)), request=np.arange(requests),
                          position=np.zeros(requests, np.int64), iteration=np.arange(requests), path="h.parquet")
    monkeypatch.setattr(inputs, "available_memory", lambda: 2**30)
    with pytest.raises(ConfigError, match=r"h.parquet: the EAMs of its 1,000 requests \(256 layers x 4096 experts "
                                          r"each\) would need 23.4 GiB of memory, and 1.0 GiB is available"):
        sequence_eams(history)


# ------------------------------------------------------------------ no output over an input or another output

def test_simulate_never_writes_over_its_hardware_profile_or_another_output(tmp_path, capsys):
    from pathlib import Path

    profile = tmp_path / "mine.toml"
    profile.write_text((Path(__file__).parents[1] / "src/moe_offload/hardware/presets/desktop-rtx4090.toml")
                       .read_text())
    before = profile.read_bytes()
    code, _, err = run(capsys, "simulate", "--timed", "olmoe", "--hardware", profile, "--timed-json", profile)
    assert_refused(code, err, profile, "is also an input of this command")
    assert profile.read_bytes() == before
    plot = tmp_path / "both.png"
    code, _, err = run(capsys, "simulate", "--timed", "olmoe", "--plot-cdf", plot, "--plot-timeline", plot)
    assert_refused(code, err, plot, "is also an input of this command")
    assert not plot.exists()


def test_a_sweep_running_in_another_process_keeps_the_second_one_out(small_sweep, capsys):
    import subprocess
    import sys

    results = small_sweep.parent / "results.parquet"
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from moe_offload.sweep.store import ResultStore; "
                               f"store = ResultStore({str(results)!r}, []); print('locked', flush=True); "
                               "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        code, _, err = run(capsys, "sweep", small_sweep)
        assert_refused(code, err, results, "another sweep is writing these results now")
    finally:
        holder.communicate("")  # its end releases the lock
    assert run(capsys, "sweep", small_sweep)[0] == 0


def test_a_sweep_into_a_symlink_to_a_running_sweeps_results_is_refused(small_sweep, capsys):
    """Issue 33: ``r.parquet`` and ``alias.parquet -> r.parquet`` written at once both said "results written"
    and kept 16 of 32 rows: the lock was per name. It is the lock of the file the name resolves to."""
    from moe_offload.sweep.store import ResultStore

    results = small_sweep.parent / "results.parquet"
    alias = small_sweep.parent / "alias.parquet"
    alias.symlink_to(results.name)
    (small_sweep.parent / "alias.toml").write_text(small_sweep.read_text().replace("results.parquet",
                                                                                   "alias.parquet"))
    with ResultStore(results, []):  # the first sweep, running, into results.parquet
        code, _, err = run(capsys, "sweep", small_sweep.parent / "alias.toml")
        assert_refused(code, err, "alias.parquet", "another sweep is writing these results now")
    with ResultStore(alias, []):  # and the other way round
        code, _, err = run(capsys, "sweep", small_sweep)
        assert_refused(code, err, results, "another sweep is writing these results now")
    assert not results.exists()
