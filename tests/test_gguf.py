"""GGUF checkpoints (models/gguf.py): a tiny random Qwen3-MoE written as llama.cpp writes GGUF (tests/gguf_files.py)
packs to the very bytes its safetensors save packs to, generates the same tokens, dequantizes Q8_0 to ggml's
d * q, is packed once, and every refusal is one line before any tensor is read."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="the 'gguf' extra is not installed (pip install 'moe-offload[gguf]')")
pytest.importorskip("accelerate", reason="the 'gguf' extra is not installed (pip install 'moe-offload[gguf]')")

from cli_driver import assert_refused, run  # noqa: E402
from gguf_files import q8_0_values, save_checkpoint, tiny_qwen2_moe, tiny_qwen3_moe, write_gguf  # noqa: E402

from moe_offload.runtime.packing import read_manifest  # noqa: E402

PROMPT = "User: what is a cache?\nAssistant:"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One tiny Qwen3-MoE as a safetensors checkpoint, an F32 GGUF and a Q8_0 GGUF."""
    folder = tmp_path_factory.mktemp("gguf")
    model = tiny_qwen3_moe()
    f32 = write_gguf(model, folder / "tiny-F32.gguf")
    return {"checkpoint": save_checkpoint(model, folder / "checkpoint", f32), "f32": f32,
            "q8_0": write_gguf(model, folder / "tiny-Q8_0.gguf", quantization="Q8_0")}


def pack(capsys, source, output, *options):
    code, out, err = run(capsys, "pack", source, "-o", output, *options)
    assert code == 0, err
    return read_manifest(output)


def expert_regions(manifest) -> dict:
    """(layer, expert) -> the bytes of its region in the layer files."""
    regions = {}
    for (layer, expert), entry in manifest.experts.items():
        with open(manifest.layer_path(layer), "rb") as handle:
            handle.seek(entry.offset)
            regions[layer, expert] = handle.read(manifest.expert_bytes)
    return regions


def test_the_f32_gguf_packs_to_the_bytes_of_its_safetensors_save(files, tmp_path, capsys):
    from_gguf = pack(capsys, files["f32"], tmp_path / "from-gguf")
    from_safetensors = pack(capsys, files["checkpoint"], tmp_path / "from-safetensors")
    assert (from_gguf.model_type, from_gguf.num_layers, from_gguf.num_experts, from_gguf.top_k) == \
        ("qwen3_moe", 2, 4, 2)
    assert from_gguf.dtype == "float32" and from_gguf.tensors == from_safetensors.tensors
    assert expert_regions(from_gguf) == expert_regions(from_safetensors)
    assert (tmp_path / "from-gguf" / "non-experts.safetensors").read_bytes() == \
        (tmp_path / "from-safetensors" / "non-experts.safetensors").read_bytes()
    leftovers = [path.name for path in tmp_path.iterdir()]
    assert sorted(leftovers) == ["from-gguf", "from-safetensors"]  # the float checkpoint is gone


def test_a_qwen2_moe_gguf_with_its_shared_expert_packs_and_generates_as_its_checkpoint(tmp_path, capsys):
    model = tiny_qwen2_moe()
    gguf_file = write_gguf(model, tmp_path / "qwen2.gguf")
    checkpoint = save_checkpoint(model, tmp_path / "checkpoint", gguf_file)
    from_gguf = pack(capsys, gguf_file, tmp_path / "from-gguf")
    pack(capsys, checkpoint, tmp_path / "from-safetensors")
    assert from_gguf.model_type == "qwen2_moe"
    for name in ("experts/layer000.bin", "experts/layer001.bin", "non-experts.safetensors"):  # shared expert too
        assert (tmp_path / "from-gguf" / name).read_bytes() == (tmp_path / "from-safetensors" / name).read_bytes()
    assert generated(capsys, tmp_path, tmp_path / "from-gguf")[0] == \
        generated(capsys, tmp_path, tmp_path / "from-safetensors")[0]


def test_expert_dtype_applies_to_a_gguf_as_to_any_checkpoint(files, tmp_path, capsys):
    from_gguf = pack(capsys, files["f32"], tmp_path / "gguf-f16", "--expert-dtype", "float16")
    from_safetensors = pack(capsys, files["checkpoint"], tmp_path / "st-f16", "--expert-dtype", "float16")
    assert from_gguf.dtype == "float16" and expert_regions(from_gguf) == expert_regions(from_safetensors)


def test_q8_0_experts_are_packed_as_ggml_dequantizes_them(files, tmp_path, capsys):
    import gguf

    manifest = pack(capsys, files["q8_0"], tmp_path / "q8")
    reader = gguf.GGUFReader(files["q8_0"])
    stored = {tensor.name: tensor for tensor in reader.tensors}
    assert stored["blk.0.ffn_gate_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    regions = expert_regions(manifest)
    for layer in range(2):
        gate, up, down = (q8_0_values(np.asarray(stored[f"blk.{layer}.ffn_{part}_exps.weight"].data))
                          for part in ("gate", "up", "down"))
        for expert in range(4):
            expected = np.concatenate([gate[expert], up[expert]]).tobytes() + down[expert].tobytes()
            assert regions[layer, expert] == expected
    # and the values moved: Q8_0 is not the float32 original
    assert regions != expert_regions(pack(capsys, files["f32"], tmp_path / "f32"))


def generated(capsys, tmp_path, *model):
    record = tmp_path / "record.json"
    record.unlink(missing_ok=True)
    code, _, err = run(capsys, "generate", "--model", *model, "--max-new-tokens", "8", "--device", "cpu",
                       "--fast-budget", "50%", "--json", record, PROMPT)
    assert code == 0, err
    return json.loads(record.read_text())["token_ids"], err


def test_generate_from_the_gguf_gives_the_tokens_of_the_checkpoint_and_packs_once(files, tmp_path, capsys,
                                                                                   monkeypatch):
    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path / "cache"))
    reference, _ = generated(capsys, tmp_path, files["checkpoint"])
    tokens, err = generated(capsys, tmp_path, files["f32"])
    assert tokens == reference and "(once)" in err

    import moe_offload.models.gguf as gguf_module

    def never(*_):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(gguf_module, "write_checkpoint", never)
    tokens, err = generated(capsys, tmp_path, files["f32"])
    assert tokens == reference and "(once)" not in err
    packs = sorted(path.name for path in (tmp_path / "cache" / "packed").iterdir())
    assert [name for name in packs if name.startswith("tiny-F32-")] == [
        f"tiny-F32-{hashlib.sha256(files['f32'].read_bytes()).hexdigest()[:12]}-v3"]


def test_record_from_the_gguf_writes_the_trace_of_the_checkpoint(files, tmp_path, capsys):
    import pyarrow.parquet as pq

    tables = []
    for source in (files["f32"], files["checkpoint"]):
        trace = tmp_path / f"{source.name}.parquet"
        code, _, err = run(capsys, "record", "--model", source, "--limit", "2", "--max-new-tokens", "4",
                           "-o", trace)
        assert code == 0, err
        tables.append(pq.read_table(trace, columns=["request", "position", "experts", "weights"]).to_pydict())
    assert tables[0] == tables[1] and len(tables[0]["request"]) > 8


def test_a_hub_gguf_file_is_read_from_the_offline_cache(files, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    repo, commit = "test-org/tiny-moe-GGUF", "89abcdef0123456789abcdef0123456789abcdef"
    root = tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "snapshots" / commit).mkdir(parents=True)
    (root / "blobs").mkdir()
    blob = root / "blobs" / "f32-blob"
    blob.write_bytes(files["f32"].read_bytes())
    (root / "snapshots" / commit / "tiny-F32.gguf").symlink_to(os.path.relpath(blob, root / "snapshots" / commit))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path / "cache"))
    reference, _ = generated(capsys, tmp_path, files["checkpoint"])
    tokens, _ = generated(capsys, tmp_path, repo, "--gguf-file", "tiny-F32.gguf")
    assert tokens == reference
    assert f"test-org--tiny-moe-GGUF-{commit[:12]}-tiny-F32-v3" in os.listdir(tmp_path / "cache" / "packed")
    code, _, err = run(capsys, "pack", repo, "--gguf-file", "tiny-Q4_K_M.gguf", "-o", tmp_path / "out")
    assert_refused(code, err, "tiny-Q4_K_M.gguf", "not in the hub cache", "HF_HUB_OFFLINE")


def test_a_mixtral_declared_as_llama_is_refused_before_its_experts_are_lost(files, tmp_path, capsys):
    llama = write_gguf(tiny_qwen3_moe(), tmp_path / "mixtral.gguf", architecture="llama", expert_count=4)
    code, _, err = run(capsys, "pack", llama, "-o", tmp_path / "out")
    assert_refused(code, err, llama, "llama.expert_count = 4", "dense Llama", "experts would be lost")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("architecture, why", [("olmoe", "transformers cannot read this architecture"),
                                                ("gpt-oss", "adapters do not know")])
def test_architectures_that_cannot_run_are_refused_saying_why(tmp_path, capsys, architecture, why):
    other = write_gguf(tiny_qwen3_moe(), tmp_path / f"{architecture}.gguf", architecture=architecture)
    code, _, err = run(capsys, "generate", "--model", other, "--max-new-tokens", "1", PROMPT)
    assert_refused(code, err, other, repr(architecture), why, "qwen2moe, qwen3moe")


def test_one_shard_of_a_split_gguf_is_refused_before_its_missing_tensors_become_random(tmp_path, capsys):
    shard = write_gguf(tiny_qwen3_moe(), tmp_path / "model-00001-of-00003.gguf", split_count=3)
    code, _, err = run(capsys, "pack", shard, "-o", tmp_path / "out")
    assert_refused(code, err, shard, "shard 1 of a GGUF split into 3 files", "llama-gguf-split --merge")


def test_a_gguf_lacking_tensors_is_refused_not_filled_with_random_weights(tmp_path, capsys, monkeypatch):
    import gguf_files

    every = gguf_files.gguf_tensors
    monkeypatch.setattr(gguf_files, "gguf_tensors",
                        lambda model, names: ((n, t) for n, t in every(model, names) if not n.startswith("blk.1.")))
    partial = write_gguf(tiny_qwen3_moe(), tmp_path / "partial.gguf")
    code, _, err = run(capsys, "pack", partial, "-o", tmp_path / "out")
    # found once transformers has read the tensors, after its own progress bar: the refusal is the last line
    assert_refused(code, err.splitlines()[-1] + "\n", partial, "lacks the tensor for model.layers.1.", "and 10 more")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["partial.gguf"]  # no float checkpoint left


def test_a_truncated_or_foreign_file_is_refused_in_one_line(files, tmp_path, capsys):
    data = files["f32"].read_bytes()
    for name, content in (("half.gguf", data[:len(data) // 2]), ("header.gguf", data[:100]),
                          ("text.gguf", b"not a gguf file\n")):
        (tmp_path / name).write_bytes(content)
        code, _, err = run(capsys, "pack", tmp_path / name, "-o", tmp_path / "out")
        assert_refused(code, err, tmp_path / name)
        assert "truncated" in err or "not a readable GGUF file" in err


def test_without_the_gguf_package_one_line_names_the_extra(files, tmp_path, capsys, monkeypatch):
    import moe_offload.models.gguf as gguf_checkpoints

    importable = gguf_checkpoints._importable
    monkeypatch.setattr(gguf_checkpoints, "_importable", lambda module: module != "gguf" and importable(module))
    code, _, err = run(capsys, "pack", files["f32"], "-o", tmp_path / "out")
    assert_refused(code, err, "needs gguf", "pip install 'moe-offload[gguf]'")


def test_gguf_file_needs_a_hub_id_and_a_gguf_name(files, tmp_path, capsys):
    code, _, err = run(capsys, "pack", files["checkpoint"], "--gguf-file", "x.gguf", "-o", tmp_path / "out")
    assert_refused(code, err, "--gguf-file x.gguf", "not a hub id")
    code, _, err = run(capsys, "pack", "org/name", "--gguf-file", "model.safetensors", "-o", tmp_path / "out")
    assert_refused(code, err, "--gguf-file model.safetensors", "not a GGUF file name")
    code, _, err = run(capsys, "pack", tmp_path / "absent.gguf", "-o", tmp_path / "out")
    assert_refused(code, err, "absent.gguf", "no such GGUF file")


def test_declared_counts_the_file_cannot_hold_are_refused_before_reading(tmp_path, capsys):
    """Issue 33: a 4 kB GGUF whose header holds an array of 2^40 entries ran 79 s to 7.5 GB in the gguf
    package's reader; it is refused from the header's own arithmetic (models/gguf_header.py)."""
    import struct

    from gguf_files import header_only_gguf

    cases = {
        "bytes.gguf": (9, struct.pack("<IQ", 0, 2**40), "declares 1,099,511,627,776 array elements"),
        "strings.gguf": (9, struct.pack("<IQ", 8, 2**40), "declares 1,099,511,627,776 array elements"),
        "string.gguf": (8, struct.pack("<Q", 2**40), "needs 1,099,511,627,776 bytes"),
        "nested.gguf": (9, struct.pack("<IQ", 9, 1) * 20, "nests arrays more than 8 deep"),
        "kind.gguf": (77, b"", "unknown type 77"),
    }
    for name, (kind, value, problem) in cases.items():
        path = header_only_gguf(tmp_path / name, kind, value)
        code, _, err = run(capsys, "pack", path, "-o", tmp_path / "out")
        assert_refused(code, err, path, problem)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(cases)


def test_fields_of_the_wrong_type_or_size_are_one_line_before_work(tmp_path, capsys):
    """Issue 33: ``block_count`` 2^31 ran 187 s; ``split.count`` or an expert FFN length as a string were
    tracebacks."""
    import gguf

    kinds = gguf.GGUFValueType
    cases = [({"qwen3moe.block_count": (2**31, kinds.UINT32)}, "qwen3moe.block_count is 2,147,483,648"),
             ({"split.count": ("3", kinds.STRING)}, "split.count must be a non-negative integer, not '3'"),
             ({"qwen3moe.expert_feed_forward_length": ("32", kinds.STRING)},
              "qwen3moe.expert_feed_forward_length must be a non-negative integer"),
             ({"qwen3moe.expert_feed_forward_length": (2**40, kinds.UINT64)},
              "more than any dimension of the file's tensors"),
             ({"qwen3moe.embedding_length": (1.5, kinds.FLOAT32)}, "qwen3moe.embedding_length must be")]
    model = tiny_qwen3_moe()
    for i, (metadata, problem) in enumerate(cases):
        path = write_gguf(model, tmp_path / f"case{i}.gguf", metadata=metadata)
        code, _, err = run(capsys, "pack", path, "-o", tmp_path / "out")
        assert_refused(code, err, path, problem)
        assert not (tmp_path / "out").exists()
