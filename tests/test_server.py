"""The OpenAI-compatible server (moe_offload/server), in-process on a free port, through the real `openai`
client: completions, chat, streaming, stop sequences, seeded sampling, concurrent clients getting the
tokens they get alone, /metrics moving, every bad input a 4xx OpenAI error, a disconnect freeing its slot,
an engine failure a 5xx with the server serving on, SIGTERM a clean exit. OpenAI's parameters and hostile
input: tests/test_server_hostile.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from moe_offload.api import load  # noqa: E402
from moe_offload.plan import make_plan  # noqa: E402
from moe_offload.runtime.engine import OffloadEngine  # noqa: E402
from moe_offload.runtime.pack_cache import packed_directory  # noqa: E402
from moe_offload.runtime.packing import read_manifest  # noqa: E402
from moe_offload.server import ServerThread  # noqa: E402
from moe_offload.text.sources import chat_prompt  # noqa: E402
from waits import RESULT_WAIT_S  # noqa: E402

QUESTIONS = ["what is a cache?", "hi", "tell me about the history of Rome", "how do I sort a list in Python?",
             "why is the sky blue?", "write a poem about the sea"]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def alone():
    """Each question's greedy answer when it runs alone (transformers' generate)."""
    with load("tiny", fast_budget="30%", policy="lru") as engine:
        return {q: engine.generate(chat_prompt(q), max_new_tokens=NEW_TOKENS) for q in QUESTIONS}


@pytest.fixture(scope="module")
def server():
    with load("tiny", fast_budget="30%", policy="lcp", prefetch="moepic", max_batch=4) as engine:
        with ServerThread(engine, "tiny") as running:
            yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def raw(server, path: str, body: bytes | None = None, method: str = "POST", headers=None) -> tuple[int, dict | str]:
    """(status, JSON body or text) of one request over plain HTTP, as a client that is no SDK sends it."""
    request = urllib.request.Request(server.url + path, data=body, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def metrics(server) -> dict:
    _, text = raw(server, "/metrics", method="GET")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_models_and_health(client, server):
    assert [model.id for model in client.models.list().data] == ["tiny"]
    assert raw(server, "/health", method="GET") == (200, {"status": "ok", "running": 0, "waiting": 0})


def test_completion_and_chat_give_the_tokens_of_the_request_alone(client, alone):
    question = QUESTIONS[0]
    completion = client.completions.create(model="tiny", prompt=chat_prompt(question), max_tokens=NEW_TOKENS,
                                           temperature=0)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                          max_tokens=NEW_TOKENS, temperature=0)
    reference = alone[question]
    assert completion.choices[0].text == chat.choices[0].message.content == reference.text
    assert completion.choices[0].finish_reason == chat.choices[0].finish_reason == "length"
    assert chat.choices[0].message.role == "assistant"
    prompt_tokens = reference.prompt_tokens
    for response in (completion, chat):
        assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == \
            (prompt_tokens, NEW_TOKENS, prompt_tokens + NEW_TOKENS)
        counters = response.model_extra["moe_offload"]
        assert counters["expert_requests"] >= counters["expert_hits"] >= 0
        assert counters["expert_requests"] > 0 and counters["ttft_seconds"] > 0


def test_streaming_sends_the_same_text_in_pieces(client, alone):
    question = QUESTIONS[2]
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": question}], max_tokens=NEW_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == alone[question].text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS and not chunks[-1].choices
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=chat_prompt(question), max_tokens=NEW_TOKENS, temperature=0, stream=True))
    assert streamed == alone[question].text


def test_concurrent_clients_each_get_the_tokens_they_get_alone(client, server, alone):
    def ask(i_question):
        i, question = i_question
        messages = [{"role": "user", "content": question}]
        if i % 2:
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True) if c.choices)
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW_TOKENS,
                                              temperature=0).choices[0].message.content

    before = metrics(server)
    with ThreadPoolExecutor(len(QUESTIONS) * 2) as pool:
        answers = list(pool.map(ask, enumerate(QUESTIONS * 2)))
    assert answers == [alone[q].text for q in QUESTIONS * 2]
    after = metrics(server)
    passes = after[("moe_offload_batch_size_count", ())] - before[("moe_offload_batch_size_count", ())]
    batched = after[("moe_offload_batch_size_sum", ())] - before[("moe_offload_batch_size_sum", ())]
    assert batched / passes > 1.5  # the requests shared forward passes (max_batch 4)


def test_stop_sequences_are_not_returned(client, alone):
    question = QUESTIONS[0]
    reference = alone[question].text
    stop = reference[len(reference) // 2:][:2]
    response = client.completions.create(model="tiny", prompt=chat_prompt(question), max_tokens=NEW_TOKENS,
                                         temperature=0, stop=[stop])
    assert response.choices[0].text == reference[:reference.index(stop)]
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens < NEW_TOKENS


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return client.completions.create(model="tiny", prompt=chat_prompt(QUESTIONS[4]), max_tokens=12,
                                         temperature=1.0, top_p=0.95, seed=seed).choices[0].text

    with ThreadPoolExecutor(4) as pool:  # the two seed-3 requests run in different batches
        first, other, second, greedy = pool.map(lambda f: f(), [lambda: sample(3), lambda: sample(4),
                                                                lambda: sample(3), lambda: sample(5)])
    assert first == second and first != other


def test_metrics_move_as_requests_run(client, server):
    before = metrics(server)
    client.completions.create(model="tiny", prompt="User: hi\nAssistant:", max_tokens=5, temperature=0)
    after = metrics(server)

    def grew(name, labels=()):
        key = (name, tuple(sorted(labels)))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("moe_offload_expert_requests_total", [("tier", "fast")]) > 0
    assert grew("moe_offload_requests_total", [("finish_reason", "length")]) == 1
    assert grew("moe_offload_generated_tokens_total") == 5
    assert grew("moe_offload_ttft_seconds_count") == 1 and grew("moe_offload_tpot_seconds_count") == 1
    assert grew("moe_offload_batch_size_count") == 5  # the prompt's pass, then 4 decode passes
    hits = after[("moe_offload_expert_hits_total", (("tier", "fast"),))]
    asked = after[("moe_offload_expert_requests_total", (("tier", "fast"),))]
    assert after[("moe_offload_expert_hit_rate", (("tier", "fast"),))] == pytest.approx(hits / asked)
    assert after[("moe_offload_link_bytes_total", (("link", "ssd->fast"),))] > 0
    assert grew("moe_offload_policy_decisions_total") >= 0 and ("moe_offload_policy_decision_seconds_total", ()) in after
    assert after[("moe_offload_requests_running", ())] == after[("moe_offload_requests_waiting", ())] == 0


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    (COMPLETIONS, b"{not json", 400, None),
    (COMPLETIONS, b"[1, 2]", 400, None),
    (COMPLETIONS, b"\xff\xfe", 400, None),
    (CHAT, {"model": "gpt-4", "messages": MESSAGES}, 404, "model"),
    (CHAT, {"model": "tiny"}, 400, "messages"),
    (CHAT, {"model": "tiny", "messages": []}, 400, "messages"),
    (CHAT, {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    (COMPLETIONS, {"model": "tiny"}, 400, "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, None),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "max_tokens": -3}, 400, None),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "max_completion_tokens": 0}, 400, None),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "max_tokens": 100000}, 400, None),
    (COMPLETIONS, {"model": "tiny", "prompt": "word " * 1500, "max_tokens": 1}, 400, None),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "n": 0}, 400, "n"),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools"),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "no_such_parameter": 1}, 400, "no_such_parameter"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages.0.content.0.type"),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "temperature": 7}, 400, "temperature"),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "top_p": 0}, 400, "top_p"),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "stop": [""]}, 400, "stop"),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "seed": -1}, 400, "seed"),
    (COMPLETIONS, {"model": "tiny", "prompt": [999999]}, 400, None),
    ("/v1/nothing", {"model": "tiny"}, 404, None),
]


@pytest.mark.parametrize("path, body, status, param", BAD_REQUESTS)
def test_bad_input_is_an_openai_error_with_a_4xx(server, path, body, status, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, answer = raw(server, path, data)
    assert got == status, answer
    assert isinstance(answer, dict) and set(answer) == {"error"}, answer
    assert answer["error"]["message"] and "Traceback" not in answer["error"]["message"]
    if param is not None:
        assert answer["error"]["param"] == param


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=50000)


def test_two_hundred_malformed_requests_leave_the_server_healthy(server, client):
    for i in range(200):
        path, body, status, _ = BAD_REQUESTS[i % len(BAD_REQUESTS)]
        assert raw(server, path, body if isinstance(body, bytes) else json.dumps(body).encode())[0] == status
    assert raw(server, "/health", method="GET")[0] == 200
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_a_client_that_disconnects_frees_its_slot(server):
    before = metrics(server)
    body = json.dumps({"model": "tiny", "prompt": "User: hi\nAssistant:", "max_tokens": 900, "temperature": 0,
                       "stream": True}).encode()
    request = urllib.request.Request(server.url + COMPLETIONS, data=body, headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=300)
    assert response.readline().startswith(b"data: ")
    response.close()
    deadline = time.monotonic() + RESULT_WAIT_S  # a guard against a hang: the cancel reaches the scheduler
    while raw(server, "/health", method="GET")[1]["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = metrics(server)
    key = ("moe_offload_requests_total", (("finish_reason", "cancelled"),))
    assert after.get(key, 0) - before.get(key, 0) == 1
    assert raw(server, "/health", method="GET")[1]["running"] == 0
    generated = after[("moe_offload_generated_tokens_total", ())] - before[("moe_offload_generated_tokens_total", ())]
    assert generated < 900


def test_an_engine_failure_is_a_5xx_naming_it_and_the_server_serves_on(tmp_path):
    packed = tmp_path / "packed"
    shutil.copytree(packed_directory("tiny"), packed)
    layer_file = read_manifest(packed).layer_path(0)
    intact = layer_file.read_bytes()
    broken = bytearray(intact)
    for i in range(0, len(broken), 4096):  # every expert of layer 0: every request needs one
        broken[i] ^= 0xFF
    with OffloadEngine(make_plan(packed, fast_budget="30%")) as engine, ServerThread(engine, "packed") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        layer_file.write_bytes(bytes(broken))
        with pytest.raises(openai.InternalServerError, match=r"layer000\.bin.*checksum mismatch"):
            client.completions.create(model="packed", prompt="hi", max_tokens=3)
        status, answer = raw(server, COMPLETIONS, json.dumps({"model": "packed", "prompt": "hello", "max_tokens": 3,
                                                              "stream": True}).encode())
        assert status == 200 and "checksum mismatch" in answer and '"type": "server_error"' in answer
        layer_file.write_bytes(intact)
        assert client.completions.create(model="packed", prompt="hi", max_tokens=3).usage.completion_tokens == 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_finishes_the_server_and_exits_zero():
    port = _free_port()
    command = [sys.executable, "-m", "moe_offload.cli.main", "serve", "--port", str(port), "--fast-budget", "30%"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + RESULT_WAIT_S  # starting (importing torch, packing) on a loaded machine
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    assert response.status == 200
                    break
            except OSError:  # not listening yet, or too busy starting to answer within the second
                assert process.poll() is None and time.monotonic() < deadline, process.stdout.read().decode()
                time.sleep(0.1)
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 30, "stream": True}).encode()
        response = urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}{COMPLETIONS}", data=body, headers={"Content-Type": "application/json"}),
            timeout=RESULT_WAIT_S)
        assert response.readline().startswith(b"data: ")
        process.send_signal(signal.SIGTERM)  # the running request finishes within the grace period
        assert response.read().decode().rstrip().endswith("data: [DONE]")
        response.close()
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_serve_options_are_checked_before_the_model_loads(capsys):
    from moe_offload.cli.main import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv, problem in [(["--port", "0"], "--port '0': must be a whole number from 1 to 65,535"),
                              (["--max-batch", "none"], "--max-batch 'none': must be a whole number"),
                              (["--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
                              (["--host", "no.such.host.invalid"], "--host 'no.such.host.invalid'"),
                              (["--max-body", "lots"], "--max-body 'lots': is not a byte count"),
                              (["--max-body", "10"], "--max-body '10': at least 1KiB"),
                              (["--api-key", " "], "--api-key: printable ASCII")]:
            assert main(["serve", *argv]) == 2
            err = capsys.readouterr().err
            assert problem in err and len(err.strip().splitlines()) == 1, err
