"""Issue 23, pack and packed models: a broken checkpoint is refused naming the file or tensor before anything
is written; a pack's manifest is sealed and stays inside its directory; a pack that cannot be read is one
line, never a traceback."""

from __future__ import annotations

import json
import re
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from model_configs import build, tiny_tokenizer  # noqa: E402

from cli_driver import assert_refused, run  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Mixtral (3 layers of 6 experts) saved in float16, with a tokenizer."""
    root = tmp_path_factory.mktemp("hostile-pack")
    model, _ = build("mixtral", seed=5)
    model.half().save_pretrained(root / "model")
    tiny_tokenizer().save_pretrained(root / "model")
    return root / "model"


@pytest.fixture
def copy(checkpoint, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(checkpoint, target)
    return target


def edit_config(model_dir, change) -> None:
    path = model_dir / "config.json"
    path.write_text(change(path.read_text()))


def edit_weights(model_dir, change) -> None:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(path)
    change(weights)
    save_file(weights, path, metadata={"format": "pt"})


def refused_pack(capsys, model_dir, *fragments) -> None:
    out = model_dir.parent / "packed"
    code, _, err = run(capsys, "pack", model_dir, "-o", out)
    assert_refused(code, err, *fragments)
    assert not out.exists() and not [p for p in model_dir.parent.iterdir() if p.name.startswith(".packed")]


def test_a_checkpoint_missing_one_layers_experts_is_refused_naming_the_tensor(copy, capsys):
    layer_1_experts = "model.layers.1.block_sparse_moe.experts."
    edit_weights(copy, lambda w: [w.pop(name) for name in list(w) if name.startswith(layer_1_experts)])
    refused_pack(capsys, copy, "the weight files lack the tensor for model.layers.1.mlp.experts.down_proj")


def test_a_config_with_fewer_layers_than_the_weights_is_refused(copy, capsys):
    edit_config(copy, lambda text: re.sub(r'"num_hidden_layers": \d+', '"num_hidden_layers": 2', text))
    refused_pack(capsys, copy, copy / "model.safetensors", "holds layer 2", "num_hidden_layers=2")


def test_a_config_with_more_layers_than_the_weights_is_refused(copy, capsys):
    edit_config(copy, lambda text: re.sub(r'"num_hidden_layers": \d+', '"num_hidden_layers": 4', text))
    refused_pack(capsys, copy, "hold no tensor of layer 3", "num_hidden_layers=4")


def test_a_billion_layers_is_refused_at_once(copy, capsys):
    edit_config(copy, lambda text: re.sub(r'"num_hidden_layers": \d+', '"num_hidden_layers": 1000000000', text))
    refused_pack(capsys, copy, copy / "config.json", "num_hidden_layers must be an integer in 1..1024")


def test_nan_weights_are_refused_naming_the_tensor(copy, capsys):
    def poison(weights):
        weights["model.layers.1.self_attn.q_proj.weight"][3, 4] = float("nan")

    edit_weights(copy, poison)
    refused_pack(capsys, copy, "weight model.layers.1.self_attn.q_proj.weight holds NaN or infinity")


@pytest.mark.parametrize("value, problem", [("NaN", "rms_norm_eps is NaN, not a number"),
                                            ("0", "rms_norm_eps must be a positive"),
                                            ("-1e-6", "rms_norm_eps must be a positive")])
def test_a_nan_or_non_positive_rms_norm_eps_is_refused(copy, capsys, value, problem):
    edit_config(copy, lambda text: re.sub(r'"rms_norm_eps": [^,\n]+', f'"rms_norm_eps": {value}', text))
    refused_pack(capsys, copy, copy / "config.json", problem)


def test_a_config_nested_100k_deep_is_refused(copy, capsys):
    edit_config(copy, lambda _: '{"a":' * 100_000 + "1" + "}" * 100_000)
    refused_pack(capsys, copy, copy / "config.json", "nested too deeply")


def test_a_weight_map_pointing_outside_the_checkpoint_is_refused(copy, capsys):
    (copy / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"lm_head.weight": "../../../../etc/passwd"}}))
    refused_pack(capsys, copy, "model.safetensors.index.json", "'../../../../etc/passwd'", "lm_head.weight")


def test_a_full_disk_while_packing_is_one_line_and_leaves_nothing(checkpoint, tmp_path, capsys, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):  # what safetensors raises when the disk fills under it
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    code, _, err = run(capsys, "pack", checkpoint, "-o", tmp_path / "packed")
    assert_refused(code, err, tmp_path / "packed", "cannot write", "No space left on device")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ a packed model: sealed, inside its directory

@pytest.fixture(scope="module")
def packed(checkpoint):
    from moe_offload.runtime.packing import pack_model

    pack_model(checkpoint, checkpoint.parent / "packed")
    return checkpoint.parent / "packed"


@pytest.fixture
def pack_copy(packed, tmp_path):
    target = tmp_path / "packed"
    shutil.copytree(packed, target)
    return target


def reseal(directory, change) -> None:
    """What a hostile user can do: edit the manifest (and files) and compute every digest and the seal anew."""
    from moe_offload.inputs import file_sha256
    from moe_offload.runtime.pack_seal import seal_of
    from moe_offload.runtime.packing import MANIFEST

    path = directory / MANIFEST
    document = json.loads(path.read_text())
    document["files"] = {name: file_sha256(directory / name) for name in document["files"]}
    change(document)
    document["seal"] = seal_of(document)
    path.write_text(json.dumps(document))


def refused_start(capsys, directory, *fragments) -> None:
    code, _, err = run(capsys, "generate", "--model", directory, "--max-new-tokens", 1, "x")
    assert_refused(code, err, *fragments)


def test_a_pack_runs_as_written(packed, capsys):
    code, out, err = run(capsys, "generate", "--model", packed, "--max-new-tokens", 2, "x")
    assert code == 0, err


def test_an_edit_of_the_manifest_without_its_seal_is_refused(pack_copy, capsys):
    from moe_offload.runtime.packing import MANIFEST

    path = pack_copy / MANIFEST
    path.write_text(path.read_text().replace('"top_k": 2', '"top_k": 1'))
    refused_start(capsys, pack_copy, path, "does not match its seal")


def test_a_resealed_manifest_pointing_a_layer_at_another_layers_bytes_is_refused(pack_copy, capsys):
    def point_layer_2_at_layer_0(document):
        document["layers"][2]["file"] = document["layers"][0]["file"]
        for entry in document["experts"]:
            if entry["layer"] == 2:
                source = next(e for e in document["experts"] if e["layer"] == 0 and e["expert"] == entry["expert"])
                entry["sha256"], entry["xxh3"] = source["sha256"], source["xxh3"]

    reseal(pack_copy, point_layer_2_at_layer_0)
    refused_start(capsys, pack_copy, "layer 2's experts are in 'experts/layer000.bin'")


def test_a_resealed_manifest_pointing_outside_the_pack_is_refused(pack_copy, capsys):
    reseal(pack_copy, lambda document: document["files"].update({"../../../etc/hostname": ""}))
    refused_start(capsys, pack_copy, "'../../../etc/hostname' leads outside the pack directory")


def test_a_symlink_leading_outside_the_pack_is_refused(pack_copy, tmp_path, capsys):
    from moe_offload.runtime.packing import NON_EXPERTS

    outside = tmp_path / "elsewhere.safetensors"
    (pack_copy / NON_EXPERTS).rename(outside)
    (pack_copy / NON_EXPERTS).symlink_to(outside)
    refused_start(capsys, pack_copy, "leads outside the pack directory")


def test_a_changed_config_of_a_pack_is_refused(pack_copy, capsys):
    config = pack_copy / "config.json"
    config.write_text(config.read_text().replace('"vocab_size": 300', '"vocab_size": 301'))
    refused_start(capsys, pack_copy, config, "checksum mismatch")


@pytest.mark.parametrize("change, problem", [
    (lambda d: d.update(expert_bytes=2**62), "expert_bytes 4611686018427387904"),
    (lambda d: d["expert_tensors"][0].update(shape=[32, 96]), "expert tensor gate_up_proj has shape [32, 96]"),
    (lambda d: d["expert_tensors"][0].update(shape=[96, 320], bytes=96 * 320 * 2), "does not follow"),
    (lambda d: d.update(num_layers=10**9), "lists 18 experts, expected 1000000000 x 6"),
])
def test_a_resealed_manifest_with_impossible_sizes_is_refused(pack_copy, capsys, change, problem):
    reseal(pack_copy, change)
    refused_start(capsys, pack_copy, problem)


def test_a_resealed_config_nested_100k_deep_is_refused(pack_copy, capsys):
    config = pack_copy / "config.json"
    config.write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    reseal(pack_copy, lambda document: None)
    refused_start(capsys, pack_copy, config, "nested too deeply")


def test_a_resealed_vocab_size_is_refused_naming_the_tensor(pack_copy, capsys):
    config = pack_copy / "config.json"
    config.write_text(config.read_text().replace('"vocab_size": 300', '"vocab_size": 1000000000000'))
    reseal(pack_copy, lambda document: None)
    refused_start(capsys, pack_copy, "has shape [300, 32], config.json gives the model [1000000000000, 32]")


@pytest.mark.parametrize("part", ["", "experts", "moe-offload-pack.json", "non-experts.safetensors"])
def test_an_unreadable_part_of_a_pack_is_one_line(pack_copy, capsys, monkeypatch, part):
    """The directory, experts/, the manifest, the non-expert file: each refused naming what cannot be read
    (as root, which reads anything, the system calls fail as they would for another user)."""
    import errno
    import os

    denied_under = os.fspath(pack_copy / part) if part else os.fspath(pack_copy) + os.sep
    real_stat, real_open = os.stat, os.open

    def deny(real):
        def call(path, *args, **kwargs):
            name = os.fspath(path) if not isinstance(path, int) else ""
            if name == denied_under or (name.startswith(denied_under.rstrip(os.sep) + os.sep)):
                raise PermissionError(errno.EACCES, "Permission denied", name)
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "stat", deny(real_stat))
    monkeypatch.setattr(os, "open", deny(real_open))
    refused_start(capsys, pack_copy, "permission denied")


# ------------------------------------------------------------------ no output over the model a command runs

@pytest.mark.parametrize("target", ["moe-offload-pack.json", "config.json", "tokenizer.json", "link-to-config.json"])
def test_generate_json_never_writes_over_the_model(pack_copy, capsys, target):
    (pack_copy / "link-to-config.json").symlink_to(pack_copy / "config.json")
    before = {path: path.read_bytes() for path in pack_copy.rglob("*") if path.is_file()}
    code, _, err = run(capsys, "generate", "--model", pack_copy, "--max-new-tokens", 1, "--json",
                       pack_copy / target, "x")
    assert_refused(code, err, target, "is also an input of this command")
    assert {path: path.read_bytes() for path in pack_copy.rglob("*") if path.is_file()} == before


def test_hardware_measure_never_writes_over_the_model(pack_copy, tmp_path, capsys):
    link = tmp_path / "profile.toml"
    link.symlink_to(pack_copy / "config.json")
    before = (pack_copy / "config.json").read_bytes()
    code, _, err = run(capsys, "hardware", "measure", "--model", pack_copy, "-o", link)
    assert_refused(code, err, link, "is also an input of this command")
    assert (pack_copy / "config.json").read_bytes() == before


def test_generate_json_never_writes_over_the_cached_pack_of_a_checkpoint(checkpoint, tmp_path, capsys, monkeypatch):
    from moe_offload.runtime.pack_cache import packed_directory
    from moe_offload.runtime.packing import MANIFEST

    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path / "cache"))
    cached = packed_directory(str(checkpoint))
    capsys.readouterr()  # its note that it packed
    before = (cached / MANIFEST).read_bytes()
    code, _, err = run(capsys, "generate", "--model", checkpoint, "--max-new-tokens", 1, "--json",
                       cached / MANIFEST, "x")
    assert_refused(code, err, MANIFEST, "is also an input of this command")
    assert (cached / MANIFEST).read_bytes() == before
