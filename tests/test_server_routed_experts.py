"""The server's SGLang extension: ``return_routed_experts`` returns ``sgl_ext.routed_experts`` (base64 int32,
[prompt + completion - 1, L, K]) equal to what `record` sees for the same prompt, greedy, alone; also when
16 requests run batched, in a stream's last chunk, and from ``routed_experts_start_len`` on."""

from __future__ import annotations

import base64
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from moe_offload.api import load  # noqa: E402
from moe_offload.server import ServerThread  # noqa: E402
from moe_offload.text.prompts import Prompt  # noqa: E402

PROMPTS = [f"question {i}: what is {word}?" for i, word in enumerate(
    ["a cache", "the sea", "Rome", "a list", "the sky", "a poem", "an expert", "memory", "a tree", "a sort",
     "a model", "a router", "a token", "a layer", "a GPU", "a disk"])]
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def server():
    with load("tiny", fast_budget="30%", policy="lru", max_batch=16) as engine:
        with ServerThread(engine, "tiny") as running:
            yield running


@pytest.fixture(scope="module")
def recorded():
    """Each prompt's routing as `record` writes it: greedy, one prompt per batch, trace rows by position."""
    from moe_offload.models.recorder import record
    from moe_offload.models.tiny import load as load_model

    model, adapter, tokenizer = load_model("tiny")
    trace = record(model, adapter, tokenizer, [Prompt(p, f"test:{i}") for i, p in enumerate(PROMPTS)],
                   model_name="tiny", max_new_tokens=NEW_TOKENS, batch_size=1).trace
    return [trace.experts[trace.request == r].astype(np.int64) for r in range(len(PROMPTS))]


def post(server, body: dict) -> dict | list[dict]:
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        text = response.read().decode()
    if not body.get("stream"):
        return json.loads(text)
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]


def routed(choice: dict) -> np.ndarray:
    ids = np.frombuffer(base64.b64decode(choice["sgl_ext"]["routed_experts"], validate=True), dtype="<i4")
    return ids.reshape(-1, 8, 2).astype(np.int64)  # the tiny Mixtral: 8 MoE layers, top-2


def ask(prompt: str, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
            "return_routed_experts": True, **extra}


def test_routed_experts_equal_record(server, recorded):
    body = post(server, ask(PROMPTS[0]))
    usage = body["usage"]
    rows = routed(body["choices"][0])
    assert len(rows) == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    np.testing.assert_array_equal(rows, recorded[0])
    passes = body["moe_offload"]["passes"]  # alone: one pass for the prompt, one per fed generated token
    assert passes == list(range(passes[0], passes[0] + usage["completion_tokens"]))


def test_sixteen_concurrent_requests_each_get_their_own_routing(server, recorded):
    with ThreadPoolExecutor(16) as pool:
        bodies = list(pool.map(lambda p: post(server, ask(p)), PROMPTS))
    for body, expected in zip(bodies, recorded):
        np.testing.assert_array_equal(routed(body["choices"][0]), expected)


def test_stream_carries_it_in_the_last_chunk(server, recorded):
    chunks = post(server, ask(PROMPTS[1], stream=True))
    carrying = [chunk for chunk in chunks if chunk["choices"] and "sgl_ext" in chunk["choices"][0]]
    assert carrying == [chunks[-1]]
    np.testing.assert_array_equal(routed(chunks[-1]["choices"][0]), recorded[1])


def test_start_len_drops_the_first_rows(server, recorded):
    body = post(server, ask(PROMPTS[2], routed_experts_start_len=3))
    np.testing.assert_array_equal(routed(body["choices"][0]), recorded[2][3:])


def test_not_asked_not_sent(server):
    body = post(server, {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 2})
    assert "sgl_ext" not in body["choices"][0]
