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


PROMPT = "User: what is a cache?\nAssistant:"


def generate(model: str, tmp_path: Path, capsys) -> tuple[list[int], str]:
    """(token ids, stderr) of ``generate --model MODEL`` at a 25% budget."""
    record = tmp_path / f"{model.replace('/', '_')}.json"
    assert main(["generate", "--model", model, "--max-new-tokens", "12", "--device", "cpu", "--fast-budget",
                 "25%", "--json", str(record), PROMPT]) == 0
    return json.loads(record.read_text())["token_ids"], capsys.readouterr().err


def test_a_hub_id_in_the_offline_cache_generates_the_tokens_of_tiny_and_packs_once(hub_home, tmp_path, capsys):
    tiny, _ = generate("tiny", tmp_path, capsys)
    tokens, err = generate(REPO, tmp_path, capsys)
    assert tokens == tiny and "(once)" in err
    tokens, err = generate(f"{REPO}@{COMMIT}", tmp_path, capsys)  # the same commit: its pack is reused
    assert tokens == tiny and "(once)" not in err
    packs = sorted(path.name for path in (tmp_path / "packs" / "packed").iterdir())
    assert [name for name in packs if name.startswith("test-org--")] == [f"test-org--tiny-moe-{COMMIT[:12]}-v3"]


def test_the_command_line_with_hf_home_and_hf_hub_offline(hub_home, tmp_path, capsys):
    """The variables alone, in a fresh process whose hub client reads them at import."""
    arguments = ["generate", "--max-new-tokens", "6", "--device", "cpu", PROMPT]
    assert main(["generate", "--model", "tiny", *arguments[1:]]) == 0
    tiny = capsys.readouterr().out.split("\n\n")[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-m", "moe_offload.cli.main", *arguments, "--model", REPO],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n\n")[0] == tiny


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
    from moe_offload.runtime.packing import read_manifest

    assert main(["pack", REPO, "-o", str(tmp_path / "hub-pack")]) == 0
    assert main(["pack", "tiny", "-o", str(tmp_path / "tiny-pack")]) == 0
    capsys.readouterr()
    hub, tiny = read_manifest(tmp_path / "hub-pack"), read_manifest(tmp_path / "tiny-pack")
    assert hub.experts == tiny.experts and hub.non_experts_sha256 == tiny.non_experts_sha256


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


def test_each_expert_dtype_of_a_commit_is_packed_once(hub_home, tmp_path):
    from moe_offload.runtime.pack_cache import packed_directory
    from moe_offload.runtime.packing import read_manifest

    packed = packed_directory(REPO, expert_dtype="int4")
    assert packed.name == f"test-org--tiny-moe-{COMMIT[:12]}-int4-v3"
    assert read_manifest(packed).expert_dtype == "int4"
    assert packed_directory(f"{REPO}@{COMMIT}", expert_dtype="int4") == packed


def test_record_names_the_trace_after_the_hub_id(hub_home, tmp_path, capsys):
    from moe_offload.trace import read_trace

    assert main(["record", "--model", REPO, "--limit", "1", "--max-new-tokens", "2", "-o",
                 str(tmp_path / "t.parquet")]) == 0
    capsys.readouterr()
    assert read_trace(tmp_path / "t.parquet").meta.model == REPO


def test_a_revision_that_climbs_out_of_the_cache_is_refused(hub_home, tmp_path, capsys):
    """Issue 33: ``org/tiny@../../../elsewhere/refx``, ``refx`` holding a relative path, packed a model from a
    folder outside the hub cache: the hub client reads ``refs/<revision>`` as a file path."""
    elsewhere = hub_home / "elsewhere"
    lay_out_hub_cache(elsewhere, repo="x/y")  # a complete checkpoint outside the cache
    model = next((elsewhere / "models--x--y" / "snapshots").iterdir())
    (elsewhere / "refx").write_text(os.path.relpath(model, hub_home / "hub" / "models--test-org--tiny-moe" /
                                                    "snapshots"))
    for revision in ("../../../elsewhere/refx", "main/../../../../elsewhere/refx", ".hidden", "a//b", "x.lock"):
        assert main(["generate", "--model", f"{REPO}@{revision}", "hi"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is not a branch, tag or commit name" in err, err
    assert not (tmp_path / "packs").exists()


def test_a_ref_file_holding_a_path_is_refused(hub_home, tmp_path, capsys):
    elsewhere = hub_home / "elsewhere"
    lay_out_hub_cache(elsewhere, repo="x/y")
    model = next((elsewhere / "models--x--y" / "snapshots").iterdir())
    snapshots = hub_home / "hub" / "models--test-org--tiny-moe" / "snapshots"
    (snapshots.parent / "refs" / "main").write_text(os.path.relpath(model, snapshots))
    assert main(["generate", "--model", REPO, "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a commit's snapshot" in err, err
    assert not (tmp_path / "packs").exists()


@pytest.mark.parametrize("model", ["org/" + "n" * 5000, "o" * 97 + "/name", "org--x/name", "org/name.git"])
def test_names_the_hub_would_refuse_are_no_hub_ids(model, capsys):
    """huggingface_hub's validate_repo_id: 96 characters at most, no '--' or '..', no '.git' ending. A 5,000
    character id was a 'File name too long' traceback."""
    assert hub_id(model) is None
    assert main(["generate", "--model", model, "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and len(err) < 400 + min(len(model), 5000), err
