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
from model_configs import build  # noqa: E402

from moe_offload.cli.main import main  # noqa: E402


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(code: int, err: str, *fragments) -> None:
    assert code == 2, err
    assert err.startswith("moe-offload") and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert str(fragment) in err, err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Mixtral (3 layers of 6 experts) saved in float16."""
    root = tmp_path_factory.mktemp("hostile-pack")
    model, _ = build("mixtral", seed=5)
    model.half().save_pretrained(root / "model")
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
    edit_weights(copy, lambda w: [w.pop(name) for name in list(w) if name.startswith("model.layers.1.block_sparse_moe.experts.")])
    refused_pack(capsys, copy, "the weight files lack model.layers.1.mlp.experts.down_proj")


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


@pytest.mark.parametrize("value, problem", [("NaN", "NaN is not a JSON number"), ("0", "rms_norm_eps must be a positive"),
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
