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

from tiny_server import NEW_TOKENS, PROMPTS  # noqa: E402


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


def test_routed_experts_equal_record(tiny_server, tiny_recorded):
    body = post(tiny_server, ask(PROMPTS[0]))
    usage = body["usage"]
    rows = routed(body["choices"][0])
    assert len(rows) == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    np.testing.assert_array_equal(rows, tiny_recorded[0])
    passes = body["moe_offload"]["passes"]  # alone: one pass for the prompt, one per fed generated token
    assert passes == list(range(passes[0], passes[0] + usage["completion_tokens"]))


def test_sixteen_concurrent_requests_each_get_their_own_routing(tiny_server, tiny_recorded):
    with ThreadPoolExecutor(16) as pool:
        bodies = list(pool.map(lambda p: post(tiny_server, ask(p)), PROMPTS))
    for body, expected in zip(bodies, tiny_recorded):
        np.testing.assert_array_equal(routed(body["choices"][0]), expected)


def test_stream_carries_it_in_the_last_chunk(tiny_server, tiny_recorded):
    chunks = post(tiny_server, ask(PROMPTS[1], stream=True))
    carrying = [chunk for chunk in chunks if chunk["choices"] and "sgl_ext" in chunk["choices"][0]]
    assert carrying == [chunks[-1]]
    np.testing.assert_array_equal(routed(chunks[-1]["choices"][0]), tiny_recorded[1])


def test_start_len_drops_the_first_rows(tiny_server, tiny_recorded):
    body = post(tiny_server, ask(PROMPTS[2], routed_experts_start_len=3))
    np.testing.assert_array_equal(routed(body["choices"][0]), tiny_recorded[2][3:])


def test_not_asked_not_sent(tiny_server):
    body = post(tiny_server, {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 2})
    assert "sgl_ext" not in body["choices"][0]
