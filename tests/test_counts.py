"""Counts-only inputs (trace/counts.py): a table counted from a full trace gives the frequency-placement
coverage the replay of static-freq in hindsight measures on that trace, whatever the file's layout; a
malformed table is one line naming the file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_offload.errors import TraceError
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.counts import ExpertCounts, read_counts


def write_layouts(folder, trace) -> list:
    """The counts of ``trace`` as every layout read_counts takes."""
    counts = ExpertCounts.of_trace(trace).counts
    L, J = counts.shape
    wide = folder / "wide.csv"
    wide.write_text("layer," + ",".join(map(str, range(J))) + "\n"
                    + "".join(f"{layer}," + ",".join(str(int(c)) for c in row) + "\n" for layer, row in enumerate(counts)))
    bare = folder / "bare.csv"
    bare.write_text("".join(",".join(str(int(c)) for c in row) + "\n" for row in counts))
    long = folder / "long.csv"
    long.write_text("layer,expert,count\n" + "".join(f"{l},{j},{int(counts[l, j])}\n" for l in range(L)
                                                      for j in range(J)))
    as_json = folder / "c.json"
    as_json.write_text(json.dumps({"logical_count": counts.astype(int).tolist()}))
    steps = folder / "steps.npy"  # SGLang's [buffered steps, layers, experts]: the first tokens, then the rest
    first = ExpertCounts.of_trace(trace.select(slice(0, trace.num_tokens // 3))).counts
    np.save(steps, np.stack([first, counts - first]).astype(np.int32))
    return [wide, bare, long, as_json, steps]


@pytest.mark.parametrize("budget", [8, 32, 100])
def test_counts_give_the_coverage_the_replay_measures_on_the_full_trace(tmp_path, tiny_trace, budget):
    run = replay(ReplayInput.of(tiny_trace, "tiny"), "static-freq", budget)
    expected = run.hits / run.accesses
    for path in write_layouts(tmp_path, tiny_trace):
        assert read_counts(path).frequency_coverage([budget]) == [pytest.approx(expected, abs=1e-12)], path


def test_a_routing_array_is_not_read_as_counts(tmp_path, tiny_trace):
    # [tokens, layers, top_k] has the rank of SGLang's [steps, layers, experts]: its rows of distinct ids that sum
    # differently across a token's layers tell it apart, and the refusal names the import that reads it
    routing = tmp_path / "routing.npy"
    np.save(routing, tiny_trace.experts.astype(np.int32))
    with pytest.raises(TraceError, match=r"routing.npy: an integer array \[\d+, 8, 2\] whose every row holds 2 "
                                         r"different values.* is routing .*`moe-offload trace import npy "):
        read_counts(routing)
    # counts of single tokens are 0s and 1s, rows that repeat values: still counts
    one_token_steps = tmp_path / "steps.npy"
    experts = tiny_trace.experts[:5]
    steps = np.zeros((5, 8, 8), np.int32)
    for token in range(5):
        for layer in range(8):
            steps[token, layer, experts[token, layer]] = 1
    np.save(one_token_steps, steps)
    assert read_counts(one_token_steps).total == 5 * 8 * 2


def test_placement_host_layers_and_skew_by_hand():
    counts = ExpertCounts(np.array([[9.0, 1, 0, 0], [3, 3, 3, 3], [0, 0, 0, 0]]))
    assert counts.frequency_coverage([1, 2, 3, 12]) == pytest.approx([9 / 22, 12 / 22, 15 / 22, 1.0])
    assert np.argwhere(counts.placement(2)).tolist() == [[0, 0], [1, 0]]
    assert counts.host_layers(2) == [2] and counts.host_layers(1) == [1, 2]
    skew = counts.layer_skew()
    assert skew[0].top_share == pytest.approx(0.9) and skew[1].entropy_ratio == pytest.approx(1.0)
    assert skew[2].requests == 0


@pytest.mark.parametrize("name,body,fragment", [
    ("a.csv", "1,2\n3\n", "line 2: 1 counts, the first layer has 2"),
    ("b.csv", "1,x\n", "line 1: 'x' is not a count"),
    ("c.csv", "1,-2\n", "count -2.0 is not a finite non-negative number"),
    ("d.json", '{"other": 1}', "'counts' or 'logical_count', and this one has 'other': a routing log is converted "
                              "with `moe-offload trace import FORMAT "),
    ("d2.json", '{"meta": {"num_experts": 4}, "routes": []}', "has 'meta', 'routes': a routing log is converted "
                                                               "with `moe-offload trace import routes-json "),
    ("e.json", "[[1, 2], [3]]", "rectangular table"),
    ("f.csv", "0,0\n0,0\n", "every count is 0"),
    ("g.txt", "1", "a counts table is"),
    # routing logs have an order to replay; read as wide tables they would be counts of nothing
    ("h.csv", "request,token,layer,expert\n0,0,0,1\n", "a routing log (header request,token,layer,expert), not a "
                                                        "counts table: convert it with `moe-offload trace import csv "),
    ("i.csv", "layer,expert\n0,1\n1,3\n", "not a counts table: convert it with `moe-offload trace import llamacpp "),
    ("j.csv", "Phase,token,layer,rank,expert\nprefill,0,0,0,3\n", "trace import llamacpp "),
])
def test_malformed_tables_are_one_line(tmp_path, name, body, fragment):
    (tmp_path / name).write_text(body)
    with pytest.raises(TraceError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        read_counts(tmp_path / name)


def test_sglang_dump_is_read_without_running_its_code(tmp_path, tiny_trace):
    torch = pytest.importorskip("torch")
    counts = ExpertCounts.of_trace(tiny_trace).counts
    torch.save({"rank": 0, "logical_count": torch.tensor(counts[None].astype(np.int32)),
                "average_utilization_rate_over_window": None}, tmp_path / "expert_distribution_recorder_1.pt")
    np.testing.assert_array_equal(read_counts(tmp_path / "expert_distribution_recorder_1.pt").counts, counts)

    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"logical_count": Payload()}, tmp_path / "hostile.pt", _use_new_zipfile_serialization=True)
    with pytest.raises(TraceError, match="hostile.pt: not a readable PyTorch file"):
        read_counts(tmp_path / "hostile.pt")


def test_report_of_a_counts_table_prints_the_replayed_coverage_and_names_what_needs_a_trace(tmp_path, tiny_trace,
                                                                                             capsys):
    from moe_offload.cli.main import main

    counts = ExpertCounts.of_trace(tiny_trace).counts
    np.savetxt(tmp_path / "c.csv", counts.astype(int), fmt="%d", delimiter=",")
    run = replay(ReplayInput.of(tiny_trace, "tiny"), "static-freq", 16)
    assert main(["report", str(tmp_path / "c.csv"), "--fast-memory", "16"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"keeping the 16 most requested experts serves {run.hits / run.accesses:.2%}" in out
    assert "needs a full trace" in out and "the bound (Belady's hit rate" in out
    assert main(["report", str(tmp_path / "c.csv"), "--fast-memory", "16", "-o", str(tmp_path / "r.html")]) == 2
    assert not (tmp_path / "r.html").exists()
