"""Issue 11, row by row: corrupt data is refused (never read as other numbers), a failed write loses no
file, every bad input ends in one line with exit 2 and no traceback, limits are enforced, messages say
what is wrong. (The runtime's rows, pack and generate, are tested with the runtime.)"""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from moe_offload import outputs
from moe_offload.bundled import DEFAULT_TRACE, TINY_HISTORY_TRACE
from moe_offload.cli.main import main
from moe_offload.errors import TraceError
from moe_offload.trace import integrity
from moe_offload.trace.format import METADATA_KEY, Trace, TraceMeta, read_trace, write_trace
from moe_offload.trace.synthetic import zipf_trace
from cli_driver import assert_refused, run  # noqa: E402


@pytest.fixture
def trace_file(tmp_path) -> Path:
    trace = zipf_trace(num_layers=3, num_experts=8, top_k=2, length=40, a=1.0, b=1.0, seed=4)
    trace.meta = TraceMeta(model="z", num_layers=3, num_experts=8, top_k=2, expert_bytes=4096)
    return write_trace(trace, tmp_path / "small.parquet")


def reseal_with_metadata(path: Path, change) -> Path:
    """What a hostile user can do: edit the metadata and compute a valid checksum for it (the checksum
    guards against corruption; the bounds of the metadata against such files)."""
    table = pq.read_table(path)
    stored = dict(table.schema.metadata)
    document = json.loads(stored[METADATA_KEY])
    change(document)
    seal = json.loads(stored[integrity.CHECKSUM_KEY])
    seal["metadata"] = integrity.metadata_digest(document)
    stored[METADATA_KEY] = json.dumps(document).encode()
    stored[integrity.CHECKSUM_KEY] = json.dumps(seal).encode()
    pq.write_table(table.replace_schema_metadata(stored), path)
    return path


# ------------------------------------------------------------------ silent wrong results from a corrupt trace

def same_trace(a: Trace, b: Trace) -> bool:
    return a.meta == b.meta and all(
        (x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype and x.shape == y.shape
                                      and x.tobytes() == y.tobytes())
        for x, y in ((getattr(a, n), getattr(b, n)) for n in ("request", "position", "phase", "iteration",
                                                                "experts", "weights", "probs", "embedding",
                                                                "gate_prediction")))


def test_bit_flips_in_the_bundled_trace_read_back_identical_or_are_refused(tmp_path):
    """A sample of benchmarks/bitflip.py's sweep (which flips every bit): all bits of every 101st byte of the
    footer and every 1,499th of the column pages."""
    clean, data = read_trace(DEFAULT_TRACE), DEFAULT_TRACE.read_bytes()
    footer_start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    positions = list(range(4, footer_start, 1499)) + list(range(footer_start, len(data), 101))
    outcomes = {"identical": 0, "refused": 0}
    damaged_path = tmp_path / "damaged.parquet"
    for position in positions:
        for bit in range(8):
            damaged = bytearray(data)
            damaged[position] ^= 1 << bit
            damaged_path.write_bytes(damaged)
            try:
                got = read_trace(damaged_path)
            except TraceError as error:
                assert str(damaged_path) in str(error) and "\n" not in str(error)
                outcomes["refused"] += 1
                continue
            assert same_trace(got, clean), f"byte {position} bit {bit} reads back as other data"
            outcomes["identical"] += 1
    assert outcomes["refused"] > 0.5 * len(positions) * 8  # most flips are caught, the others change nothing


def test_a_flip_that_old_readers_missed_is_now_refused(tmp_path, capsys):
    """Data pages: a flip in the zstd frame of the expert ids decoded as other ids before the checksum."""
    clean = DEFAULT_TRACE.read_bytes()
    column = pq.ParquetFile(DEFAULT_TRACE).metadata.row_group(0).column(4)  # experts
    position = column.data_page_offset + column.total_compressed_size // 2
    damaged = bytearray(clean)
    damaged[position] ^= 0x10
    path = tmp_path / "olmoe.parquet"
    path.write_bytes(damaged)
    code, _, err = run(capsys, "simulate", path, "--policy", "lru", "--cache-size", "64")
    assert_refused(code, err, path, "corrupt")


def test_duplicated_rows_are_refused(tmp_path):
    trace = zipf_trace(num_layers=2, num_experts=4, top_k=2, length=6, a=1.0, b=0.0, seed=0)
    rows = np.array([0, 1, 2, 2, 3, 4, 5])
    with pytest.raises(TraceError, match="row 3: duplicates row 2: request 0 has position 2 twice"):
        Trace.build(trace.meta, trace.experts[rows], position=trace.position[rows], iteration=np.arange(7))


@pytest.mark.parametrize("command", [["simulate", "{trace}", "--policy", "lru", "--cache-size", "4"],
                                     ["trace", "info", "{trace}"]])
def test_absurd_metadata_is_refused_before_anything_is_allocated(trace_file, capsys, command):
    reseal_with_metadata(trace_file, lambda document: document.update(num_experts=2**40))
    code, _, err = run(capsys, *(part.format(trace=trace_file) for part in command))
    assert_refused(code, err, trace_file, "num_experts=1099511627776", "more than the 16,777,216")


@pytest.mark.parametrize("field, value", [("top_k", 99), ("expert_bytes", 2**60), ("num_layers", 0),
                                          ("hidden_size", -1)])
def test_out_of_range_metadata_is_refused(trace_file, field, value):
    reseal_with_metadata(trace_file, lambda document: document.update({field: value}))
    with pytest.raises(TraceError, match=field):
        read_trace(trace_file)


def test_ids_beyond_the_id_type_are_refused_not_wrapped(tmp_path):
    import pyarrow as pa

    table = pq.read_table(write_trace(zipf_trace(num_layers=1, num_experts=4, top_k=1, length=3, a=1.0, b=0.0,
                                                 seed=0), tmp_path / "t.parquet"))
    wide = pa.FixedSizeListArray.from_arrays(pa.array([0, 1, 260], pa.uint16()), 1)  # 260 would wrap to 4
    table = table.set_column(4, "experts", wide)
    stored = dict(table.schema.metadata)
    document = json.loads(stored[METADATA_KEY])
    document["format_version"] = 1  # an unsealed file: the checks behind the checksum's
    del stored[integrity.CHECKSUM_KEY]
    stored[METADATA_KEY] = json.dumps(document).encode()
    pq.write_table(table.replace_schema_metadata(stored), tmp_path / "wide.parquet")
    with pytest.raises(TraceError, match="row 2: expert id 260 is beyond the ids of a model with 4 experts"):
        read_trace(tmp_path / "wide.parquet", unsealed=True)


def test_an_unsealed_trace_is_refused_until_sealed(trace_file, capsys):
    table = pq.read_table(trace_file)
    stored = dict(table.schema.metadata)
    del stored[integrity.CHECKSUM_KEY]  # as written before traces were sealed (format 1)
    document = json.loads(stored[METADATA_KEY])
    document["format_version"] = 1
    stored[METADATA_KEY] = json.dumps(document).encode()
    pq.write_table(table.replace_schema_metadata(stored), trace_file)
    code, _, err = run(capsys, "trace", "info", trace_file)
    assert_refused(code, err, trace_file, "has no checksum", "moe-offload trace seal")
    code, out, _ = run(capsys, "trace", "seal", trace_file)
    assert code == 0 and "sealed" in out
    assert read_trace(trace_file).num_tokens == 40


# ------------------------------------------------------------------------------- files lost on a failed write

def test_a_write_past_the_file_size_limit_keeps_the_existing_file(tmp_path):
    """A real failure: the kernel's file-size limit (EFBIG, as a full disk gives ENOSPC) stops the trace
    write half-way; the file that was at the output path stays as it was and no partial file is left."""
    target = tmp_path / "trace.parquet"
    target.write_bytes(b"the previous trace")
    limit = 16 * 1024

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = subprocess.run([sys.executable, "-m", "moe_offload.cli.main", "trace", "synth", "zipf", "--length",
                             "20000", "-o", str(target)], capture_output=True, text=True, preexec_fn=limit_file_size)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "cannot write" in result.stderr and str(target) in result.stderr
    assert target.read_bytes() == b"the previous trace"
    assert [p.name for p in tmp_path.iterdir()] == ["trace.parquet"]


@pytest.fixture
def failing_disk(monkeypatch):
    """Every atomic write fails at its last step (after the bytes were written), as a full disk would."""
    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs, "_fsync", full)


@pytest.mark.parametrize("make_command", [
    lambda trace, out: ["trace", "flatten", trace, "-o", out],
    lambda trace, out: ["trace", "flatten", trace, "-o", out, "--format", "oracle-general"],
    lambda trace, out: ["simulate", trace, "--timed", "--cache-size", "8", "--timed-json", out, "--jobs", "1"],
    lambda trace, out: ["simulate", trace, "--policy", "lru", "--cache-size", "8", "--plot", out + ".png"],
    lambda trace, out: ["trace", "synth", "cyclic", "--layers", "2", "--cache-size", "5", "-o", out],
])
def test_a_failed_write_leaves_the_existing_output_as_it_was(trace_file, tmp_path, capsys, failing_disk,
                                                               make_command):
    out = tmp_path / "result"
    command = make_command(trace_file, str(out))
    target = Path(command[command.index("--plot") + 1]) if "--plot" in command else out
    target.write_bytes(b"precious")
    code, _, err = run(capsys, *command)
    assert_refused(code, err, target, "No space left on device")
    assert target.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["small.parquet", target.name])


def test_a_device_node_or_fifo_at_the_output_is_never_replaced(trace_file, tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    code, _, err = run(capsys, "trace", "flatten", trace_file, "-o", fifo)
    assert_refused(code, err, fifo, "not a regular file")
    assert fifo.exists() and not fifo.is_file()


@pytest.mark.parametrize("command", [
    lambda src: ["trace", "import", "topk-jsonl", src, "--experts", "64", "-o", src],
    lambda src: ["trace", "flatten", src, "-o", src],
])
def test_a_command_never_writes_over_its_own_input(tmp_path, capsys, trace_file, command):
    source = tmp_path / "input"
    source.write_bytes(trace_file.read_bytes())
    code, _, err = run(capsys, *command(source))
    assert_refused(code, err, "is also an input of this command")
    assert source.read_bytes() == trace_file.read_bytes()


# ------------------------------------------------------------------------------------------------ tracebacks

@pytest.mark.parametrize("option, message", [
    ("lcp.rho=abc", "lcp.rho 'abc': must be a number in (0, 1)"),
    ("lcp.rho=-1", "lcp.rho -1: must be a number in (0, 1)"),
    ("lcp.rho=NaN", "lcp.rho nan: must be a number in (0, 1) (a finite one)"),
    ("lcp.depth=3", "policy 'lcp' has no option depth; it takes omega=128.0, rho=0.25"),
    ("learned.model_path=5", "learned.model_path 5: must be a non-empty string"),
])
def test_bad_policy_option_values(trace_file, capsys, option, message):
    code, _, err = run(capsys, "simulate", trace_file, "--policy", "lcp,learned", "--cache-size", "8",
                       "--policy-option", option)
    assert_refused(code, err, message)


@pytest.mark.parametrize("flag", ["--timed-json", "--plot-cdf", "--plot-timeline"])
@pytest.mark.parametrize("problem", ["directory", "file in the way", "wrong extension"])
def test_bad_output_paths_are_refused_before_the_work(trace_file, tmp_path, capsys, flag, problem):
    (tmp_path / "folder").mkdir()
    (tmp_path / "blocker").write_text("x")
    if problem == "wrong extension" and flag == "--timed-json":
        return  # JSON goes to any name
    target = {"directory": tmp_path / "folder", "file in the way": tmp_path / "blocker" / "out.png",
              "wrong extension": tmp_path / "plot.txt"}[problem]
    code, _, err = run(capsys, "simulate", trace_file, "--timed", "--cache-size", "8", flag, target)
    fragment = {"directory": "is a directory", "file in the way": "cannot be created",
                "wrong extension": "must end in .png or .svg or .pdf"}[problem]
    assert_refused(code, err, target, fragment)


def test_the_replay_plot_needs_a_plot_extension(trace_file, tmp_path, capsys):
    code, _, err = run(capsys, "simulate", trace_file, "--plot", tmp_path / "misses.jpgx")
    assert_refused(code, err, "must end in .png or .svg or .pdf")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_refused(trace_file, tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        code, _, err = run(capsys, "trace", "flatten", trace_file, "-o", folder / "out.csv")
        assert_refused(code, err, "is not writable")
    finally:
        folder.chmod(0o700)


def test_train_eviction_and_record_check_their_outputs_first(trace_file, tmp_path, capsys):
    pytest.importorskip("torch")
    code, _, err = run(capsys, "train-eviction", trace_file, "-o", tmp_path)
    assert_refused(code, err, "is a directory")
    code, _, err = run(capsys, "record", "--prompts", "humaneval", "--limit", "1", "-o", tmp_path / "t.parquet",
                       "--texts", tmp_path / "t.parquet")
    assert_refused(code, err, "is also an input of this command")


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_deeply_nested_json_is_refused_in_one_line(trace_file, tmp_path, capsys):
    routes = tmp_path / "routes.json"
    routes.write_text('{"routes": ' + nested(100_000) + "}")
    code, _, err = run(capsys, "trace", "import", "routes-json", routes, "-o", tmp_path / "t.parquet")
    assert_refused(code, err, routes, "nested too deeply")
    split = tmp_path / "split.json"
    split.write_text(nested(100_000))
    code, _, err = run(capsys, "simulate", trace_file, "--timed", "--split-config", split)
    assert_refused(code, err, split, "nested too deeply")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(nested(100_000) + "\n")
    from moe_offload.text.prompts import load_prompts

    with pytest.raises(Exception) as error:
        load_prompts(str(prompts))
    assert "nested too deeply" in str(error.value)


@pytest.mark.parametrize("argv, fragment", [
    (["simulate", "{trace}", "--cache-size", "inf%"], "--cache-size 'inf%': a percentage must be in (0, 100]"),
    (["simulate", "{trace}", "--plot", "{tmp}/p.png", "--plot-points", "2000000000"],
     "--plot-points 2000000000: must be a whole number from 2 to 23"),
    (["trace", "synth", "zipf", "--length", "1e12", "-o", "{tmp}/t.parquet"], "invalid int value: '1e12'"),
    (["trace", "synth", "zipf", "--length", "1000000000000", "-o", "{tmp}/t.parquet"],
     "length 1000000000000: must be a whole number from 1 to 2,147,483,647"),
    (["trace", "synth", "zipf", "--layers", "32", "--length", "2000000000", "-o", "{tmp}/t.parquet"],
     "more than this machine's"),
    (["configure", "tiny", "--vram-budget", "inf", "--expert-load-ms", "1", "--expert-compute-ms", "1",
      "--attention-ms", "1"], "--vram-budget 'inf': a fraction must be in (0, 1]"),
    (["simulate", "{trace}", "--timed", "--arrivals", "times:1e400"], "arrival times must be finite"),
])
def test_huge_or_non_finite_numbers(trace_file, tmp_path, capsys, argv, fragment):
    code, _, err = run(capsys, *(a.format(trace=trace_file, tmp=tmp_path) for a in argv))
    assert_refused(code, err, fragment)


def test_experts_beyond_any_id_type(tmp_path, capsys, olmoe_file):
    code, _, err = run(capsys, "trace", "import", "topk-jsonl", olmoe_file, "--experts", "5000000000",
                       "-o", tmp_path / "t.parquet")
    assert_refused(code, err, "num_experts (--experts) 5000000000: must be a whole number from 1 to 16,777,216")


@pytest.mark.parametrize("ratio", ["NaN", "Infinity", "1e308", "-Infinity"])
def test_split_ratios_that_are_not_numbers_in_range(trace_file, tmp_path, capsys, ratio):
    split = tmp_path / "split.json"
    split.write_text('{"layers": [' + ", ".join([f'{{"cache_size": 2, "split_ratio": {ratio}}}'] * 3) + "]}")
    code, _, err = run(capsys, "simulate", trace_file, "--timed", "--split-config", split)
    assert_refused(code, err, split)
    assert ("not a JSON number" in err) or ("split_ratio" in err and "must be a number in (0, 1]" in err)


def make_unreadable(path: Path, monkeypatch) -> None:
    """chmod 000 where that makes a file unreadable; as root, an open that fails as it would for others."""
    if os.geteuid() != 0:
        path.chmod(0)
        return
    real_open = os.open

    def denied(name, flags, *args, **kwargs):
        if os.fspath(name) == os.fspath(path):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(name))
        return real_open(name, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)


def test_an_unreadable_hardware_profile(tmp_path, capsys, monkeypatch):
    profile = tmp_path / "mine.toml"
    profile.write_text((Path(__file__).parents[1] / "src/moe_offload/hardware/presets/desktop-rtx4090.toml")
                       .read_text())
    make_unreadable(profile, monkeypatch)
    code, _, err = run(capsys, "hardware", "show", profile)
    assert_refused(code, err, profile, "unreadable (permission denied)")


# ------------------------------------------------------------------------------------------ limits enforced

def test_jobs_must_be_a_positive_number(trace_file, capsys):
    code, _, err = run(capsys, "simulate", trace_file, "--jobs", 0)
    assert_refused(code, err, "--jobs 0: must be a whole number of at least 1")


def test_a_grid_starts_no_more_threads_or_processes_than_tasks(trace_file, monkeypatch, uncompiled_policy):
    from moe_offload.simulator import grid as grid_module, kernels
    from moe_offload.simulator.grid import replay_grid
    from moe_offload.simulator.replay import ReplayInput
    from moe_offload.values import cores

    started = {"threads": [], "processes": []}

    def recording(kind, real):
        def start(*args, max_workers=None, **kwargs):
            started[kind].append(max_workers)
            return real(*args, max_workers=max_workers, **kwargs)
        return start

    monkeypatch.setattr(grid_module, "ThreadPoolExecutor", recording("threads", grid_module.ThreadPoolExecutor))
    monkeypatch.setattr(grid_module, "ProcessPoolExecutor",
                        recording("processes", grid_module.ProcessPoolExecutor))
    data = ReplayInput.of(read_trace(trace_file))
    replay_grid(data, ["lru", uncompiled_policy], [8, 12], jobs=12)
    most = 1 if cores() == 1 else 2
    if kernels.numba_available():  # lru on threads, Belady's references on one more; lru-objects on processes
        assert started == {"threads": [most + 1], "processes": [] if most == 1 else [2]}
    else:  # all six in Python: processes; the threads' pool has nothing to run
        assert started == {"threads": [1], "processes": [] if most == 1 else [2]}


@pytest.mark.parametrize("argv", [
    ["simulate", "{trace}", "--cache-size", "150%"],
    ["configure", "tiny", "--vram-budget", "150%", "--hardware", "desktop-rtx4090"],
])
def test_a_percentage_above_100_is_refused_everywhere_in_the_same_words(trace_file, capsys, argv):
    code, _, err = run(capsys, *(a.format(trace=trace_file) for a in argv))
    assert_refused(code, err, "'150%': a percentage must be in (0, 100]")


def test_an_option_of_a_component_that_does_not_run_is_refused(trace_file, capsys):
    code, _, err = run(capsys, "simulate", trace_file, "--timed", "--cache-size", "8", "--prefetch", "topk",
                       "--prefetch-option", "fmoe.distance=2")
    assert_refused(code, err, "--prefetch-option fmoe.distance=...: fmoe is not run here (--prefetch oracle,topk)")
    code, _, err = run(capsys, "simulate", trace_file, "--timed", "--cache-size", "8",
                       "--prefetch-option", "oracle.distance=2")  # the oracle always runs, as a bound
    assert code == 0, err


# ---------------------------------------------------------------------------------------- misleading messages

def test_reasons_a_trace_cannot_be_read_are_told_apart(tmp_path, capsys, monkeypatch, trace_file):
    loop = tmp_path / "loop.parquet"
    os.symlink(loop, loop)
    unreadable = tmp_path / "locked.parquet"
    unreadable.write_bytes(trace_file.read_bytes())
    make_unreadable(unreadable, monkeypatch)
    for path, fragment in ((tmp_path / "absent.parquet", "no such file"), (tmp_path, "is a directory"),
                           (loop, "symlink loop"), (unreadable, "unreadable (permission denied)")):
        code, _, err = run(capsys, "trace", "info", path)
        assert_refused(code, err, path, fragment)
        assert "corrupt" not in err


def test_bundled_trace_names_work_wherever_a_trace_does(trace_file, capsys):
    assert read_trace("tiny-history", columns=()).path == str(TINY_HISTORY_TRACE)  # as the runtime reads histories
    code, _, err = run(capsys, "simulate", trace_file, "--timed", "--prefetch", "moe-infinity", "--history",
                       "tiny-history", "--cache-size", "8")
    # the history was found and read: it is refused only for being another model's
    assert_refused(code, err, f"the history {TINY_HISTORY_TRACE} has 8 layers x 8 experts")


def test_argument_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--jobs", "many"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert "argument --jobs: invalid int value: 'many'" in err
