"""``--model ORG/NAME[@REVISION]`` through huggingface_hub's cache, offline: a hub cache is laid out from the
bundled tiny model as the hub's client lays one out (blobs named by their SHA-256, snapshot files linking to
them, ``refs/main`` naming the commit), so no test touches the network."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("huggingface_hub")

from moe_offload.bundled import TINY_MODEL_DIR  # noqa: E402
from moe_offload.cli.main import main  # noqa: E402
from moe_offload.models.hub import hub_id  # noqa: E402

REPO = "test-org/tiny-moe"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
CHECKPOINT = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def lay_out_hub_cache(hub_cache: Path, repo: str = REPO, commit: str = COMMIT, files=CHECKPOINT) -> Path:
    """``hub_cache/models--ORG--NAME`` holding ``files`` of the bundled model at ``commit``, ``main`` on it."""
    root = hub_cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for name in files:
        data = (TINY_MODEL_DIR / name).read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub_home(tmp_path, monkeypatch):
    """HF_HOME with the tiny model cached as test-org/tiny-moe, offline; the hub client of this process (whose
    settings were read at its import) pointed at it too."""
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    lay_out_hub_cache(home / "hub")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path / "packs"))
    return home


def generated_tokens(model: str, tmp_path: Path, capsys) -> list[int]:
    record = tmp_path / f"{model.replace('/', '_')}.json"
    assert main(["generate", "--model", model, "--max-new-tokens", "12", "--device", "cpu", "--fast-budget",
                 "25%", "--json", str(record), "User: what is a cache?\nAssistant:"]) == 0
    capsys.readouterr()
    return json.loads(record.read_text())["token_ids"]


def test_a_hub_id_in_the_offline_cache_generates_the_tokens_of_tiny(hub_home, tmp_path, capsys):
    tiny = generated_tokens("tiny", tmp_path, capsys)
    assert generated_tokens(REPO, tmp_path, capsys) == tiny
    assert generated_tokens(f"{REPO}@main", tmp_path, capsys) == tiny
    assert generated_tokens(f"{REPO}@{COMMIT}", tmp_path, capsys) == tiny
    packs = sorted(path.name for path in (tmp_path / "packs" / "packed").iterdir())
    # one pack for the commit, whichever way it was named, beside tiny's
    assert [name for name in packs if name.startswith("test-org--tiny-moe")] == \
        [f"test-org--tiny-moe-{COMMIT[:12]}-v3"]


def test_the_command_line_offline_with_hf_home_packs_once(hub_home, tmp_path):
    command = [sys.executable, "-m", "moe_offload.cli.main", "generate", "--model", REPO, "--max-new-tokens", "4",
               "--device", "cpu", "hello"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.run(command, capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr
    assert "(once)" in first.stderr
    second = subprocess.run(command, capture_output=True, text=True, env=env)
    assert second.returncode == 0 and "(once)" not in second.stderr
    assert first.stdout.split("\n\n")[0] == second.stdout.split("\n\n")[0]


@pytest.mark.parametrize("model, problem", [
    ("test-org/absent", "test-org/absent is not in the hub cache"),
    (f"{REPO}@v9", f"{REPO}@v9 is not in the hub cache"),
])
def test_an_id_missing_from_the_cache_is_one_line_before_any_work(hub_home, tmp_path, capsys, model, problem):
    for command in (["generate", "--model", model, "hi"], ["pack", model, "-o", str(tmp_path / "out")],
                    ["record", "--model", model, "--limit", "1", "-o", str(tmp_path / "t.parquet")]):
        assert main(command) != 0
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and problem in err and "HF_HUB_OFFLINE is set" in err, err
    assert not (tmp_path / "packs").exists() and not (tmp_path / "out").exists()


def test_a_snapshot_without_weights_is_one_line(hub_home, capsys):
    lay_out_hub_cache(hub_home / "hub", repo="test-org/config-only", files=("config.json",))
    assert main(["generate", "--model", "test-org/config-only", "hi"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "test-org/config-only" in err and "no *.safetensors" in err


def test_pack_reads_a_hub_id(hub_home, tmp_path, capsys):
    assert main(["pack", REPO, "-o", str(tmp_path / "packed")]) == 0
    assert "wrote" in capsys.readouterr().out
    tiny = generated_tokens("tiny", tmp_path, capsys)
    assert generated_tokens(str(tmp_path / "packed"), tmp_path, capsys) == tiny


def test_what_is_a_hub_id(tmp_path, monkeypatch):
    assert hub_id("org/name") == ("org/name", None)
    assert hub_id("org/name@v1.0") == ("org/name", "v1.0")
    assert hub_id("allenai/OLMoE-1B-7B-0924@refs/pr/1") == ("allenai/OLMoE-1B-7B-0924", "refs/pr/1")
    for not_an_id in ("tiny", "/abs/dir", "./org/name", "a/b/c", "org/", "../x"):
        assert hub_id(not_an_id) is None, not_an_id
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub_id("org/name") is None  # a local directory of that name wins


def test_the_server_lists_a_hub_id_as_given():
    pytest.importorskip("fastapi")
    from moe_offload.server.app import model_name

    assert model_name(REPO) == REPO and model_name("tiny") == "tiny"
