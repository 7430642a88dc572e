"""`trace capture` against servers that are slow, broken or hostile (issue 33), on loopback
(tests/hostile_servers.py): each ends in one line naming the address and the problem, within the deadlines
given (trace/bounded_http.py), with at most the answer cap read and at most a few hundred bytes quoted. The
minutes-long versions (a 2 s drip, a 1 GB answer): benchmarks/hostile_network.py."""

from __future__ import annotations

import pytest

from hostile_servers import ScriptedServer, shaped
from moe_offload.errors import ConfigError
from moe_offload.text.prompts import Prompt
from moe_offload.trace.bounded_http import QUOTE_CHARACTERS, Limits
from moe_offload.trace.capture import capture, server_url
from moe_offload.trace.importers.model_config import ModelShape

SHAPE = ModelShape("t", num_hidden_layers=2, moe_layers=(0, 1), num_experts=4, top_k=2, hidden_size=None,
                   expert_bytes=None)
PROMPTS = [Prompt("hello", "test:0")]
QUICK = Limits(connect_seconds=5, total_seconds=2, read_seconds=0.5, max_bytes=2**20)


def refusal(server, limits: Limits = QUICK, **options) -> str:
    with pytest.raises(ConfigError) as refused:
        capture(server.url, PROMPTS, engine="sglang", model_config=SHAPE, limits=limits, **options)
    message = str(refused.value)
    assert "\n" not in message and server.url in message, message
    return message


@pytest.mark.parametrize("behaviour, options, problem", [
    ("drip", {"interval": 0.05}, "the answer began but did not end within 0.5 s"),
    ("silent", {}, "no complete answer within 2 s"),
    ("endless", {}, "larger than 1,048,576 bytes"),
    ("huge-declared", {}, "declares 1,000,000,000 bytes, more than 1,048,576"),
    ("cut", {}, "the connection closed mid-answer"),
    ("not-http", {}, "not an HTTP answer"),
])
def test_a_hostile_completion_is_one_line(behaviour, options, problem):
    with ScriptedServer(behaviour, **options) as server:
        message = refusal(server)
    assert problem in message and "prompt 0" in message, message


@pytest.mark.parametrize("behaviour, problem", [("drip", "did not end within 0.5 s"), ("silent", "within 2 s"),
                                                ("endless", "larger than")])
def test_a_hostile_model_list_is_one_line(behaviour, problem):
    with ScriptedServer(behaviour, models_first=False, interval=0.05) as server:
        message = refusal(server)
    assert problem in message and "/v1/models" in message, message


def test_an_error_body_is_quoted_to_a_few_hundred_bytes():
    """Issue 33: a 1 GB error body was put whole into the message (1,000,002,715 bytes on stderr)."""
    with ScriptedServer("huge-error", size=10**8) as server:
        message = refusal(server)
    assert "answered 500" in message and len(message) < QUOTE_CHARACTERS + 300, message
    with ScriptedServer("not-found", models_first=False) as server:
        message = refusal(server)
    assert "answered 404" in message and "is --url the server's address?" in message
    assert len(message) < QUOTE_CHARACTERS + 300, message


@pytest.mark.parametrize("listing", [{"data": {"0": {"id": "m"}}}, {"data": "m"}, [1, 2], {"data": [{"id": 5}]},
                                     {"data": [["m"]]}, {"data": []}, "m"])
def test_a_model_list_of_the_wrong_shape_is_one_line(listing):
    """Issue 33: ``{"data": {...}}`` was ``KeyError: 0``."""
    with ScriptedServer(shaped(listing), models_first=False) as server:
        assert "lists no model" in refusal(server)


@pytest.mark.parametrize("answer, problem", [([1, 2], "not a JSON object"), ("text", "not a JSON object"),
                                             (None, "not a JSON object")])
def test_a_completion_of_the_wrong_shape_is_one_line(answer, problem):
    with ScriptedServer(shaped(answer)) as server:
        assert problem in refusal(server)


def test_a_refused_connection_is_one_line_within_the_connect_deadline():
    with ScriptedServer("silent") as server:
        url = server.url
    with pytest.raises(ConfigError, match="cannot reach the server"):  # the port is closed now
        capture(url, PROMPTS, engine="sglang", model_config=SHAPE, limits=QUICK)


@pytest.mark.parametrize("url, base", [("http://h:8000", "http://h:8000"), ("http://h:8000/v1", "http://h:8000"),
                                       ("http://h:8000/v1/", "http://h:8000"), ("https://h/api/v1", "https://h/api"),
                                       ("http://h/v10", "http://h/v10")])
def test_a_base_url_ending_in_v1_is_the_server(url, base):
    """Issue 36: ``--url http://host:8000/v1`` (the OpenAI client's base_url habit) fetched /v1/v1/models."""
    assert server_url(url) == base


@pytest.mark.parametrize("url", ["http://h:99999", "http://h:8000/?x=1", "http://:80"])
def test_addresses_that_cannot_be_asked_are_refused(url):
    with pytest.raises(ConfigError, match="--url"):
        server_url(url)


def test_the_command_line_ends_a_drip_with_exit_2_and_writes_nothing(tmp_path, capsys):
    from cli_driver import assert_refused, run

    (tmp_path / "p.txt").write_text("hello\n")
    with ScriptedServer("drip", interval=0.05) as server:
        code, _, err = run(capsys, "trace", "capture", "--url", server.url + "/v1", "--prompts", tmp_path / "p.txt",
                           "--model-config", "tiny", "--read-timeout", "0.5", "-o", tmp_path / "t.parquet")
    assert_refused(code, err, server.url, "did not end within 0.5 s", "--read-timeout raises it")
    assert not (tmp_path / "t.parquet").exists()
    code, _, err = run(capsys, "trace", "capture", "--url", "http://127.0.0.1:9", "--prompts", tmp_path / "p.txt",
                       "--model-config", "tiny", "--timeout", "0", "-o", tmp_path / "t.parquet")
    assert_refused(code, err, "--timeout")
