"""The generic CSV, llama.cpp's llama-moe-trace and Megatron's RouterTracer: each reads a file written here
the way its source writes it (see importers/tools.py for the citations) and gives the expected flattened
sequence; a malformed file is one line naming the file, the line and the problem."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_offload.errors import ConfigError, TraceError
from moe_offload.trace.flatten import flatten
from moe_offload.trace.format import DECODE, PREFILL
from moe_offload.trace.importers import import_csv, import_llamacpp, import_megatron
from moe_offload.trace.importers.model_config import read_model_config

# two layers, top-2, J = 4; three tokens
ROUTING = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[3, 0], [1, 2]]])


def expected_ids(routing: np.ndarray, num_experts: int = 4) -> list[int]:
    """flatten's order, worked out by hand: for each token, for each rank, for each layer, l*J + expert."""
    return [layer * num_experts + int(routing[t, layer, rank]) for t in range(len(routing))
            for rank in range(routing.shape[2]) for layer in range(routing.shape[1])]


@pytest.fixture
def shape(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2}))
    return read_model_config(path)


def test_generic_csv(tmp_path):
    lines = ["request,token,layer,expert,weight"]
    for t, token in enumerate(ROUTING):
        for layer, experts in enumerate(token):
            lines += [f"0,{t},{layer},{e},0.5" for e in experts]
    (tmp_path / "r.csv").write_text("\n".join(lines) + "\n")
    trace = import_csv(tmp_path / "r.csv", num_experts=4)
    assert flatten(trace).expert_id.tolist() == expected_ids(ROUTING)
    assert trace.weights is not None and (trace.phase == DECODE).all()


@pytest.mark.parametrize("body,fragment", [
    ("request,token,layer\n", "the first line must be the header"),
    ("request,token,layer,expert\n0,0,0,x\n", "line 2: expert 'x' is not an integer"),
    ("request,token,layer,expert\n0,0,0,1\n0,0,1,1\n0,1,0,2\n", "line 4: request 0 token 1 lists layers [0]"),
    ("request,token,layer,expert\n0,0,0,9\n", "out of range 0..3"),
    ("request,token,layer,expert,weight\n0,0,0,1,nan\n", "line 2: weight 'nan'"),
])
def test_generic_csv_refusals(tmp_path, body, fragment):
    (tmp_path / "r.csv").write_text(body)
    with pytest.raises(TraceError, match=f"r.csv: .*{fragment}".replace("[", r"\[").replace("]", r"\]")):
        import_csv(tmp_path / "r.csv", num_experts=4)


def llamacpp_rows(ubatches: list[np.ndarray], layers=(0, 1)) -> list[str]:
    """As moe-trace.cpp writes them: per ubatch, per MoE layer, the [n_tokens, k] ids token by token."""
    rows = []
    for ubatch in ubatches:
        for position, layer in enumerate(layers):
            rows += [f"{layer},{e}" for token in ubatch for e in token[position]]
    return rows


def test_llamacpp_upstream_rows(tmp_path, shape):
    """A two-token prompt ubatch, then one decode ubatch: tokens 0, 1 prefill in one pass, token 2 decode."""
    (tmp_path / "t.csv").write_text("layer,expert\n" + "\n".join(llamacpp_rows([ROUTING[:2], ROUTING[2:]])) + "\n")
    trace = import_llamacpp(tmp_path / "t.csv", model_config=shape)
    assert flatten(trace).expert_id.tolist() == expected_ids(ROUTING)
    assert trace.phase.tolist() == [PREFILL, PREFILL, DECODE] and trace.iteration.tolist() == [0, 0, 1]


def test_llamacpp_needs_the_model_config_and_whole_tokens(tmp_path, shape):
    rows = llamacpp_rows([ROUTING[:2]])
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(ConfigError, match="--model-config"):
        import_llamacpp(tmp_path / "t.csv")
    (tmp_path / "t.csv").write_text("\n".join(rows[:-1]) + "\n")  # one id short in the last layer
    with pytest.raises(TraceError, match=r"t.csv: line 1: ubatch 0: its layers route \[4, 3\] ids"):
        import_llamacpp(tmp_path / "t.csv", model_config=shape)


def test_llamacpp_fork_with_positions_and_phases(tmp_path):
    lines = ["phase,token,layer,rank,expert"]
    for t, token in enumerate(ROUTING):
        phase = "prefill" if t < 2 else "decode"
        lines += [f"{phase},{t},{layer},{rank},{e}" for layer, experts in enumerate(token)
                  for rank, e in enumerate(experts)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    trace = import_llamacpp(tmp_path / "t.csv", num_experts=4)
    assert flatten(trace).expert_id.tolist() == expected_ids(ROUTING)
    assert trace.phase.tolist() == [PREFILL, PREFILL, DECODE]


def megatron_lines(passes: dict) -> str:
    """RouterTracer._flush_records_to_disk: one record per (step, layer, rank), layer numbers from 1."""
    records = []
    for (step, rank), routing in passes.items():
        for layer in range(routing.shape[1]):
            records.append({"step": step, "stage": "pre_dispatch", "block": "decoder", "layer": layer + 1,
                            "rank": rank, "num_tokens": len(routing), "topk": routing.shape[2],
                            "top_indices": routing[:, layer].tolist()})
    records.append({"step": 0, "block": "mtp", "layer": 1, "rank": 0, "mtp_idx": 0, "top_indices": [[0, 1]]})
    return "\n".join(json.dumps(r) for r in records) + "\n"


def test_megatron_router_tracer(tmp_path):
    (tmp_path / "router_trace_rank0.jsonl").write_text(megatron_lines({(0, 0): ROUTING[:2], (1, 0): ROUTING[2:]}))
    trace = import_megatron(tmp_path / "router_trace_rank0.jsonl", num_experts=4)
    assert flatten(trace).expert_id.tolist() == expected_ids(ROUTING)
    assert trace.num_requests == 2 and trace.iteration.tolist() == [0, 0, 1]
    assert trace.meta.extra["layer_ids"] == [1, 2] and trace.meta.extra["records_left_out"] == 1


@pytest.mark.parametrize("record,fragment", [
    ({"step": 0, "layer": 1, "rank": 0}, "missing key"),
    ({"step": 0, "layer": 1, "rank": 0, "top_indices": [[0, 1], [2]]}, "top_indices must be"),
    ({"step": "0", "layer": 1, "rank": 0, "top_indices": [[0, 1]]}, "step must be"),
    ({"step": 0, "layer": 1, "rank": 0, "top_indices": [[0, 1]], "num_tokens": 3}, "num_tokens=3"),
])
def test_megatron_refusals(tmp_path, record, fragment):
    (tmp_path / "r.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(TraceError, match=f"r.jsonl: line 1: {fragment}"):
        import_megatron(tmp_path / "r.jsonl", num_experts=4)
