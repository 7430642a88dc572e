"""`hardware measure` chooses the runtime's compute dtype and quantized experts' form per expert dtype from
measured expert times (runtime/measure/forms.py), writes them to the profile's [runtime] table, and an engine
given that profile uses them where --dtype / --expert-compute are not given."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_expert_forms import packs  # noqa: E402,F401

from moe_offload.cli.main import main  # noqa: E402
from moe_offload.errors import ConfigError  # noqa: E402
from moe_offload.hardware import HardwareProfile, load_profile  # noqa: E402
from moe_offload.hardware.profile import PRESET_DIR  # noqa: E402
from moe_offload.hardware.toml_writer import write_profile  # noqa: E402
from moe_offload.runtime import measure  # noqa: E402
from moe_offload.plan import make_plan  # noqa: E402
from moe_offload.runtime.engine import OffloadEngine  # noqa: E402
from moe_offload.runtime.measure.forms import runtime_choices  # noqa: E402


def timed(one: float, many: float = 1.0) -> dict:
    return {"seconds": {1: one, 32: many}, "arrival_s": 0.0, "slot_bytes": 1}


def test_each_expert_dtype_takes_its_fastest_one_token_form_that_keeps_its_bytes():
    forms = {
        "float16": {"float32": {"float": timed(60e-6, 400e-6)}, "bfloat16": {"float": timed(120e-6, 200e-6)}},
        "int8": {"float32": {"per-use": timed(200e-6, 500e-6), "on-arrival": timed(90e-6, 400e-6)},
                 "bfloat16": {"per-use": timed(130e-6, 400e-6), "on-arrival": timed(80e-6, 200e-6)},
                 "float16": {"per-use": timed(100e-6, 1601e-6)}},
        "int4": {"float32": {"per-use": timed(480e-6, 800e-6), "kernel": timed(840e-6, 19e-3)},
                 "bfloat16": {"per-use": timed(500e-6, 800e-6), "kernel": timed(50e-6, 230e-6)}},
    }
    # on-arrival is faster for int8 but holds float bytes: never chosen; int8 in float16 is the fastest one-token
    # form left, but its 32 tokens take more than 4 x the best 32-token time (400 us): left out
    assert runtime_choices(forms) == {"dtype": {"float16": "float32", "bfloat16": "float32", "int8": "bfloat16",
                                                "int4": "bfloat16"},
                                      "expert_compute": {"int8": "per-use", "int4": "kernel"}}
    forms["int8"]["float16"]["per-use"] = timed(100e-6, 1600e-6)  # exactly 4 x: still in
    assert runtime_choices(forms)["dtype"]["int8"] == "float16"


def test_a_measured_profile_holds_the_choices_and_the_times_behind_them(packs):  # noqa: F811
    data = measure.measure_hardware(packs["int4"], device="cpu", repeats=1, threads=1)
    profile = HardwareProfile.from_dict(data)
    assert profile.runtime.device == "cpu"
    assert set(profile.runtime.dtype) == {"float16", "bfloat16", "int8", "int4"}
    assert set(profile.runtime.dtype.values()) <= {"float32", "bfloat16", "float16"}
    assert profile.runtime.expert_compute["int8"] == "per-use"  # no int8 kernel: the only form that keeps bytes
    assert profile.runtime.expert_compute["int4"] in ("per-use", "kernel")
    text = next(source for source in profile.sources if source.startswith("runtime: one expert"))
    for part in ("float16 float in float32", "int8 on-arrival in bfloat16", "int4 kernel in bfloat16"):
        assert part in text


def profile_with(tmp_path, runtime: dict):
    """The desktop-rtx4090 preset with a [runtime] table, as a file."""
    data = tomllib.loads((PRESET_DIR / "desktop-rtx4090.toml").read_text())
    data["runtime"] = runtime
    path = tmp_path / "measured.toml"
    write_profile(data, path)
    return path


def test_an_engine_takes_the_profiles_choices_where_none_are_given(packs, tmp_path):  # noqa: F811
    path = profile_with(tmp_path, {"device": "cpu", "dtype": {"int4": "bfloat16"},
                                   "expert_compute": {"int4": "kernel"}})
    assert load_profile(path).runtime.expert_compute == {"int4": "kernel"}
    with OffloadEngine(make_plan(packs["int4"], fast_budget="50%", hardware=str(path), device="cpu")) as engine:
        assert (engine.compute_dtype, engine.expert_form.name) == (torch.bfloat16, "kernel")
    with OffloadEngine(make_plan(packs["int4"], fast_budget="50%", hardware=str(path), device="cpu", dtype="float32",
                                 expert_compute="on-arrival")) as engine:
        assert (engine.compute_dtype, engine.expert_form.name) == (torch.float32, "on-arrival")
    with OffloadEngine(make_plan(packs["int4"], fast_budget="50%", hardware=str(path), device="cpu", dtype="float32")) as engine:
        # the kernel was chosen in bfloat16: in float32 the rule applies
        assert (engine.compute_dtype, engine.expert_form.name) == (torch.float32, "per-use")
    with OffloadEngine(make_plan(packs["int8"], fast_budget="50%", hardware=str(path), device="cpu")) as engine:
        assert (engine.compute_dtype, engine.expert_form.name) == (torch.float32, "per-use")  # int8: not said
    cuda_measured = profile_with(tmp_path, {"device": "cuda", "dtype": {"int4": "bfloat16"}})
    with OffloadEngine(make_plan(packs["int4"], fast_budget="50%", hardware=str(cuda_measured), device="cpu")) as engine:
        assert engine.compute_dtype == torch.float32  # measured on another kind of device: not applied


@pytest.mark.parametrize("runtime, problem", [
    ({"device": "cpu", "dtype": {"int4": "float64"}}, "key 'runtime.dtype.int4'"),
    ({"device": "cpu", "expert_compute": {"float16": "kernel"}}, "key 'runtime.expert_compute.float16'"),
    ({"device": "tpu"}, "key 'runtime.device'"),
    ({"device": "cpu", "threads": 2}, "key 'runtime.threads'"),
])
def test_a_bad_runtime_table_is_one_line_naming_the_key(packs, tmp_path, capsys, runtime, problem):  # noqa: F811
    path = profile_with(tmp_path, runtime)
    with pytest.raises(ConfigError, match=problem.replace(".", r"\.")):
        load_profile(path)
    for command in (["generate", "--model", str(packs["int4"]), "--hardware", str(path), "x"],
                    ["serve", "--model", str(packs["int4"]), "--hardware", str(path)]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(path) in err and problem in err, command[0]


def test_measuring_a_quantized_pack_computes_its_experts_as_the_runtime_holds_them(packs):  # noqa: F811
    from moe_offload.runtime.measure.forms import quantized_weights
    from moe_offload.runtime.packing import read_manifest
    from moe_offload.runtime.storage import ExpertStore

    manifest = read_manifest(packs["int4"])
    cpu = torch.device("cpu")
    per_use = quantized_weights(manifest, (1, 2), cpu, torch.float32)()  # float32 on a CPU: dequantized per use
    store = ExpertStore(manifest)
    stored = store.read_tensors(1, 2)  # the same stored values, dequantized to float16
    store.close()
    assert all(torch.equal(per_use[name].to(torch.float16), stored[name]) for name in stored)
    kernel = quantized_weights(manifest, (1, 2), cpu, torch.bfloat16)()  # bfloat16: the int4 kernel's form
    assert type(kernel["down_proj"]).__name__ == "Int4Weight"
    float_pack = dataclasses.replace(manifest, expert_dtype=None)
    assert quantized_weights(float_pack, (0, 0), cpu, torch.float32) is None  # measured from its float tensors


def test_hardware_show_prints_the_runtime_choices(tmp_path, capsys):
    path = profile_with(tmp_path, {"device": "cpu", "dtype": {"float16": "float32", "int4": "bfloat16"},
                                   "expert_compute": {"int4": "kernel"}})
    assert main(["hardware", "show", str(path), "--expert-bytes", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "runtime choices on cpu" in out
    assert "float16 experts: --dtype float32\n" in out and "int4 experts: --dtype bfloat16 --expert-compute kernel" in out
