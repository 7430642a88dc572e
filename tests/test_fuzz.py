"""Fuzzing what the commands read: damaged traces, hostile metadata, JSON sources, hardware profiles, split
configurations and command-line values, each run through the command that reads it, in process.

For each input the outcome must be exit 0 with the clean input's results (for damage: the results of the
intact file; for a deliberate change, any results), or exit 2 with one line that names the file at fault
(or the option); never a traceback (an exception escaping ``main`` fails the test), never other numbers.
Hypothesis runs derandomized with a fixed number of examples, so the corpus is the same on every run.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_offload.cli.main import main
from moe_offload.hardware.profile import PRESET_DIR
from moe_offload.trace import integrity
from moe_offload.trace.format import METADATA_KEY, Trace, TraceMeta, read_trace, write_trace
from moe_offload.trace.synthetic import zipf_trace


def fuzz(examples: int):
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))


def invoke(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exit_:  # argparse's own errors
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def assert_refused_in_one_line(code: int, err: str, *names) -> None:
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and err.startswith("moe-offload") and "Traceback" not in err, err
    if names:
        assert any(str(name) in err for name in names), err


def results(out: str) -> list[dict]:
    """simulate --json's rows without the trace's name (the damaged copy lives elsewhere)."""
    rows = json.loads(out)
    for row in rows:
        row.pop("trace")
    return rows


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    rng = np.random.default_rng(0)
    base = zipf_trace(num_layers=3, num_experts=6, top_k=2, length=30, a=1.0, b=1.0, seed=1)
    probs = rng.dirichlet(np.ones(6), size=(30, 3))
    prediction = rng.dirichlet(np.ones(6), size=(30, 2))
    meta = TraceMeta(model="fuzz", num_layers=3, num_experts=6, top_k=2, expert_bytes=1 << 20)
    trace = Trace.build(meta, base.experts, probs=probs, gate_prediction=prediction, weights=np.full((30, 3, 2), .5))
    path = write_trace(trace, folder / "clean" / "trace.parquet")
    code, out, err = replay_json(path)
    assert code == 0, err
    return {"folder": folder, "trace": path, "bytes": path.read_bytes(), "clean": results(out),
            "clean_trace": read_trace(path)}


def same_trace(a: Trace, b: Trace) -> bool:
    return a.meta == b.meta and all(
        (x is None) == (y is None) and (x is None or (x.dtype == y.dtype and x.shape == y.shape
                                                     and x.tobytes() == y.tobytes()))
        for x, y in ((getattr(a, name), getattr(b, name)) for name in ("request", "position", "phase", "iteration",
                                                                       "experts", "weights", "probs",
                                                                       "gate_prediction")))


def replay_json(path) -> tuple[int, str, str]:
    return invoke("simulate", path, "--policy", "lru,lcp,fmoe", "--cache-size", "4,50%", "--json", "--jobs", 1)


# ------------------------------------------------------------------------------------------- damaged traces

damage = st.one_of(
    st.lists(st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(0, 7)), min_size=1,
             max_size=3),
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True)).map(lambda t: [t]),
    st.tuples(st.just("splice"), st.floats(0, 1, exclude_max=True), st.binary(min_size=1, max_size=8)).map(
        lambda t: [t]),
    st.tuples(st.just("zero"), st.floats(0, 1, exclude_max=True), st.integers(1, 64)).map(lambda t: [t]),
)


def damaged(data: bytes, edits) -> bytes:
    data = bytearray(data)
    for edit in edits:
        position = int(edit[1] * len(data))
        if edit[0] == "flip":
            data[position] ^= 1 << edit[2]
        elif edit[0] == "truncate":
            del data[position:]
        elif edit[0] == "splice":
            data[position:position] = edit[2]
        else:
            data[position:position + edit[2]] = bytes(len(data[position:position + edit[2]]))
    return bytes(data)


@fuzz(50)
@given(edits=damage)
def test_a_damaged_trace_gives_the_clean_results_or_one_line(corpus, edits):
    copy = corpus["folder"] / "damaged" / "trace.parquet"
    copy.parent.mkdir(exist_ok=True)
    data = damaged(corpus["bytes"], edits)
    copy.write_bytes(data)
    code, out, err = replay_json(copy)
    if code == 0:
        assert results(out) == corpus["clean"], f"{edits}: a damaged file gave other numbers"
        # and the columns the replay does not read (probabilities, weights) are intact too
        assert same_trace(read_trace(copy), corpus["clean_trace"]), f"{edits}: a damaged file read as other data"
    else:
        assert_refused_in_one_line(code, err, copy)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=6)
METADATA_FIELDS = ("model", "num_layers", "num_experts", "top_k", "expert_bytes", "hidden_size", "source",
                   "license", "extra", "format_version")


@fuzz(25)
@given(field=st.sampled_from(METADATA_FIELDS), value=json_values | st.integers(0, 2**41))
def test_hostile_metadata_with_a_valid_checksum_is_run_or_refused_in_one_line(corpus, field, value):
    """What the checksum cannot catch, a file made to lie: the metadata's own checks must."""
    table = pq.read_table(corpus["trace"])
    stored = dict(table.schema.metadata)
    document = json.loads(stored[METADATA_KEY])
    document[field] = value
    seal = json.loads(stored[integrity.CHECKSUM_KEY])
    seal["metadata"] = integrity.metadata_digest(document)
    stored[METADATA_KEY], stored[integrity.CHECKSUM_KEY] = json.dumps(document).encode(), json.dumps(seal).encode()
    copy = corpus["folder"] / "lying.parquet"
    pq.write_table(table.replace_schema_metadata(stored), copy)
    for argv in (("simulate", copy, "--policy", "lru", "--cache-size", "4", "--json", "--jobs", 1),
                 ("trace", "info", copy, "--json")):
        code, _, err = invoke(*argv)
        if code != 0:
            assert_refused_in_one_line(code, err, copy)


# ------------------------------------------------------------------------------------------------ JSON sources

def routes_document() -> dict:
    def route(position, phase, experts):
        return {"token_pos": position, "token_id": 7, "phase": phase,
                "layers": {str(layer): {"experts": experts[layer], "weights": [0.6, 0.4]} for layer in range(2)}}

    return {"meta": {"num_experts": 4, "top_k": 2, "num_moe_layers": 2, "model_id": "m"},
            "prompt_tokens": [1, 2], "generated_tokens": [3],
            "routes": [route(0, "prefill", [[0, 1], [2, 3]]), route(1, "prefill", [[1, 2], [3, 0]]),
                       route(2, "decode", [[3, 1], [0, 2]])]}


def paths_of(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from paths_of(child, prefix + (key,))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from paths_of(child, prefix + (index,))


@fuzz(40)
@given(choice=st.floats(0, 1, exclude_max=True), value=json_values, text_damage=st.one_of(
    st.none(), st.tuples(st.floats(0, 1, exclude_max=True), st.sampled_from(["", "{", "]", "NaN", "1e400", "\x00",
                                                                               "[" * 3000]))))
def test_a_routes_json_source_is_imported_or_refused_in_one_line(corpus, choice, value, text_damage):
    document = routes_document()
    locations = list(paths_of(document))[1:]
    *parents, last = locations[int(choice * len(locations))]
    holder = document
    for key in parents:
        holder = holder[key]
    holder[last] = value
    text = json.dumps(document)
    if text_damage is not None:
        cut = int(text_damage[0] * len(text))
        text = text[:cut] + text_damage[1] + text[cut:]
    source = corpus["folder"] / "source.json"
    source.write_text(text)
    output = corpus["folder"] / "imported.parquet"
    code, _, err = invoke("trace", "import", "routes-json", source, "-o", output)
    if code == 0:
        read_trace(output)  # what was written reads back, sealed
    else:
        assert_refused_in_one_line(code, err, source)


# ------------------------------------------------------------------------------------------- hardware profiles

PRESET = (PRESET_DIR / "desktop-rtx4090.toml").read_text()
VALUE = re.compile(r"(?m)^(\s*[A-Za-z_]+\s*=\s*)(.+)$")
TOML_VALUES = st.sampled_from(["-1", "0", "nan", "inf", "-inf", "1e400", "1e-400", '"x"', '"1 PiB"', '"-3 GB"', "[]",
                               "{}", "true", "9" * 30, "9" * 5000, '"24 GiB"', "1e308", '"' + "\\" * 3 + '"'])


@fuzz(20)
@given(choice=st.floats(0, 1, exclude_max=True), value=TOML_VALUES, drop=st.booleans())
def test_a_hardware_profile_is_used_or_refused_in_one_line(corpus, choice, value, drop):
    matches = list(VALUE.finditer(PRESET))
    match = matches[int(choice * len(matches))]
    replacement = "" if drop else match.group(1) + value
    profile = corpus["folder"] / "profile.toml"
    profile.write_text(PRESET[:match.start()] + replacement + PRESET[match.end():])
    for argv in (("hardware", "show", profile, "--expert-bytes", "1MiB"),
                 ("simulate", corpus["trace"], "--timed", "--hardware", profile, "--cache-size", "50%", "--json",
                  "--jobs", 1)):
        code, _, err = invoke(*argv)
        if code != 0:
            assert_refused_in_one_line(code, err, profile)


# ------------------------------------------------------------------------------------------ split configurations

split_entry = st.fixed_dictionaries({}, optional={"cache_size": json_values | st.integers(-3, 8),
                                                  "split_ratio": json_values | st.floats(-1, 2)})


@fuzz(25)
@given(layers=st.lists(split_entry, max_size=4) | json_values,
       raw=st.sampled_from([None, "NaN", "Infinity", "-Infinity", "1e308", "1e400"]))
def test_a_split_configuration_is_run_or_refused_in_one_line(corpus, layers, raw):
    split = corpus["folder"] / "split.json"
    text = json.dumps({"layers": layers})
    if raw is not None:
        text = json.dumps({"layers": [{"cache_size": 2, "split_ratio": 0.5}] * 2 + [{"cache_size": 2}]})
        text = text.replace('{"cache_size": 2}', '{"cache_size": 2, "split_ratio": ' + raw + "}")
    split.write_text(text)
    code, _, err = invoke("simulate", corpus["trace"], "--timed", "--split-config", split, "--json", "--jobs", 1)
    if code != 0:
        assert_refused_in_one_line(code, err, split)


# ---------------------------------------------------------------------------------------------- command values

NASTY = st.sampled_from(["inf", "-inf", "nan", "NaN%", "inf%", "150%", "0", "-0", "-1", "0.0", "1e400", "1e-400", "",
                         " ", ",", "1,,2", "0x10", "99999999999999999999", "9" * 5000, "[[[[1]]]]", "☃", "1.5",
                         "25%", "4", "3MiB", "1e308GB", "true", "null", '"s"'])
FLAGS = [
    ("simulate", "{trace}", "--cache-size", "{v}", "--json", "--jobs", "1"),
    ("simulate", "{trace}", "--policy", "lru", "--cache-size", "4", "--plot", "{dir}/p.png", "--plot-points", "{v}"),
    ("simulate", "{trace}", "--policy", "lcp", "--cache-size", "4", "--json", "--policy-option", "lcp.rho={v}"),
    ("simulate", "{trace}", "--policy", "lcp", "--cache-size", "4", "--json", "--policy-option", "lcp.omega={v}"),
    ("simulate", "{trace}", "--policy", "learned", "--cache-size", "4", "--json", "--policy-option",
     "learned.model_path={v}"),
    ("simulate", "{trace}", "--policy", "lru", "--cache-size", "4", "--json", "--jobs", "{v}"),
    ("simulate", "{trace}", "--policy", "random", "--cache-size", "4", "--json", "--seed", "{v}"),
    ("simulate", "{trace}", "--timed", "--cache-size", "{v}", "--json", "--jobs", "1"),
    ("simulate", "{trace}", "--timed", "--arrivals", "poisson:{v}", "--json", "--jobs", "1"),
    ("simulate", "{trace}", "--timed", "--arrivals", "times:{v},{v}", "--max-batch", "1", "--json", "--jobs", "1"),
    ("simulate", "{trace}", "--timed", "--max-batch", "{v}", "--json", "--jobs", "1"),
    ("simulate", "{trace}", "--timed", "--expert-bytes", "{v}", "--json", "--jobs", "1"),
    ("simulate", "{trace}", "--timed", "--timeline-iteration", "{v}", "--json", "--jobs", "1"),
    ("simulate", "{trace}", "--timed", "--prefetch", "topk", "--prefetch-option", "topk.k={v}", "--json", "--jobs",
     "1"),
    ("configure", "{trace}", "--vram-budget", "{v}", "--hardware", "desktop-rtx4090", "--json"),
    ("configure", "{trace}", "--vram-budget", "25%", "--expert-load-ms", "{v}", "--expert-compute-ms", "0.1",
     "--attention-ms", "0.1", "--json"),
    ("configure", "{trace}", "--vram-budget", "25%", "--hardware", "desktop-rtx4090", "--granularity", "{v}"),
    ("trace", "synth", "zipf", "--layers", "2", "--experts", "4", "--length", "{v}", "-o", "{dir}/z.parquet"),
    ("trace", "synth", "zipf", "--layers", "2", "--experts", "4", "--length", "5", "--a", "{v}", "-o",
     "{dir}/z.parquet"),
    ("hardware", "show", "desktop-rtx4090", "--expert-bytes", "{v}"),
]


@fuzz(60)
@given(flags=st.sampled_from(FLAGS), value=NASTY | st.text(max_size=8))
def test_a_command_line_value_is_used_or_refused_in_one_line(corpus, flags, value):
    argv = [part.format(trace=corpus["trace"], dir=corpus["folder"], v=value) for part in flags]
    code, _, err = invoke(*argv)
    if code != 0:
        assert_refused_in_one_line(code, err)
