"""`moe-offload hardware measure`: a profile measured on a tiny random Mixtral packed in a temporary directory
loads, holds positive finite rates, survives its TOML file, and drives `simulate --timed`.

Timings vary from run to run (and with whatever else the machine does), so nothing here asserts a time
beyond being positive and finite. One thread: on a loaded machine torch's thread pool can stall for tens of
milliseconds per operation, which would make the tests slow without testing anything more."""

from __future__ import annotations

import dataclasses
import math
import tomllib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from model_configs import build, tiny_tokenizer  # noqa: E402

from moe_offload.cli.main import main  # noqa: E402
from moe_offload.hardware import HardwareProfile, load_profile  # noqa: E402
from moe_offload.hardware.toml_writer import profile_toml, write_profile  # noqa: E402
from moe_offload.runtime import measure  # noqa: E402
from moe_offload.runtime.packing import pack_model  # noqa: E402

FAST = dict(repeats=1, threads=1)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A tiny random Mixtral saved in float16 with a tokenizer, and its pack (3 layers x 6 experts)."""
    root = tmp_path_factory.mktemp("measure")
    model, _ = build("mixtral")
    model.half().save_pretrained(root / "model")
    tiny_tokenizer().save_pretrained(root / "model")
    pack_model(root / "model", root / "packed")
    return root


@pytest.fixture(scope="module")
def measured(packed) -> dict:
    return measure.measure_hardware(packed / "packed", device="cpu", **FAST)


@pytest.fixture(scope="module")
def raw_measurements(packed):
    return measure.measure(packed / "packed", device="cpu", **FAST)


def rates(profile: HardwareProfile) -> list[float]:
    roof = profile.compute.roofline
    return ([link.bandwidth_bytes_per_s for link in profile.links]
            + [roof.flops_per_s, roof.memory_bandwidth_bytes_per_s])


def costs(profile: HardwareProfile) -> list[float]:
    compute = profile.compute
    return ([link.latency_s for link in profile.links] + [compute.roofline.expert_overhead_s]
            + [getattr(c, f) for c in (compute.attention, compute.router, compute.lm_head)
               for f in ("fixed_s", "per_token_s")])


def test_the_measured_dict_is_a_profile_of_this_runtime(measured):
    profile = HardwareProfile.from_dict(measured)
    # a CPU runtime: experts computed from RAM, read from their files, one link as the presets name it
    assert [t.name for t in profile.tiers] == ["host", "ssd"]
    assert [link.name for link in profile.links] == ["ssd->host"]
    assert profile.compute.roofline is not None and profile.compute.expert is None
    assert profile.compute.roofline.bytes_per_param == 2  # the pack is float16
    assert all(r > 0 and math.isfinite(r) for r in rates(profile))
    assert all(c >= 0 and math.isfinite(c) for c in costs(profile))
    assert all(t.capacity_bytes > 0 for t in profile.tiers)
    assert profile.compute.expert_seconds(1, 9216) > 0
    text = " ".join(profile.sources)
    assert "page cache bypassed" in text and "18 of 18 experts moved" in text
    # decoding with experts streaming in the background: both slowdowns measured, neither below 1
    assert "sharing: while a thread streamed experts" in text
    assert 1 <= profile.compute.slowdown_while_loading <= 100 and 1 <= profile.links[0].slowdown_while_computing <= 100
    # on a CPU the fast tier is the host: the host computes the fast tier's experts too, and its own expert is
    # measured as the runtime computes a bypassed one, from the stored copy
    assert profile.host is not None and profile.host.on_compute_device
    # in the dtype the runtime computes in with this profile (the hidden states'): its [runtime] choice
    assert (f"host: the same expert on the host CPU from the host tier's stored copy, converted to "
            f"{profile.runtime.dtype['float16']} at every call") in text


def test_the_experts_are_timed_in_the_dtype_the_profile_makes_the_runtime_compute_in(packed, monkeypatch):
    """The runtime given the profile computes in its [runtime] dtype, and a bypassed expert in the dtype of the
    hidden states: where the forms find bfloat16 fastest, the resident expert is timed in bfloat16 and the
    host's converted to bfloat16, its roofline reads 2-byte weights, and the profile says so."""
    def bfloat16_fastest(manifest, tensors, experts_module, device, repeats, token_counts=None):
        fast, slow = {1: 1e-3, 64: 2e-3}, {1: 2e-3, 64: 4e-3}
        return {"float16": {dtype: {"float": {"seconds": fast if dtype == "bfloat16" else slow, "arrival_s": 0.0,
                                              "slot_bytes": 1}} for dtype in ("float32", "bfloat16", "float16")}}
    timed = []
    real = measure.measure_expert_compute

    def recording(module, tensors, device, dtype, repeats, *args, host_copy=False, **kwargs):
        timed.append((dtype, host_copy))
        return real(module, tensors, device, dtype, repeats, *args, host_copy=host_copy, **kwargs)
    monkeypatch.setattr(measure, "measure_forms", bfloat16_fastest)
    monkeypatch.setattr(measure, "measure_expert_compute", recording)
    m = measure.measure(packed / "packed", device="cpu", **FAST)
    assert [dtype for dtype, host_copy in timed if host_copy] == [torch.bfloat16]
    assert [dtype for dtype, host_copy in timed if not host_copy] == [torch.bfloat16]  # the resident expert too
    assert m.compute_dtype == "bfloat16"
    profile = HardwareProfile.from_dict(measure.profile_dict(m))
    assert profile.runtime.dtype["float16"] == "bfloat16"
    assert profile.host.roofline.memory_bandwidth_bytes_per_s == pytest.approx(m.host_memory_bandwidth, rel=1e-3)
    assert "stored copy, converted to bfloat16 at every call" in " ".join(profile.sources)


def test_a_cuda_measurement_has_the_runtimes_tiers(packed):
    """No GPU needed: the profile of CUDA-shaped measurements has the runtime's tiers and links: without a host
    tier the data path carries the files straight into GPU memory; with one, both hops."""
    cpu = measure.measure(packed / "packed", device="cpu", **FAST)
    cuda = dataclasses.replace(cpu, device="cuda", device_name="a GPU", compute_dtype="float16",
                               host_to_gpu_latency_s=1e-5, host_to_gpu_bandwidth=25e9, convert_bandwidth=None,
                               link_seconds=9216 / 5e9, link_alone_s=9216 / 5e9 + 2e-5,
                               link_seconds_decoding=1.5 * 9216 / 5e9, decode_step_s=0.02,
                               decode_step_streaming_s=0.025,
                               capacities={"gpu": 24 * 2**30, "ssd": 2 * 10**12},
                               capacity_notes={"gpu": "free", "ssd": "disk"})
    profile = HardwareProfile.from_dict(measure.profile_dict(cuda))
    assert [t.name for t in profile.tiers] == ["gpu", "ssd"]
    assert [link.name for link in profile.links] == ["ssd->gpu"]
    assert not profile.host.on_compute_device  # the GPU computes the resident experts beside the host
    link = profile.link_from(1)
    assert link.bandwidth_bytes_per_s == pytest.approx(5e9, rel=1e-3) and link.latency_s == pytest.approx(2e-5, rel=1e-3)
    # decoding slowed the stream 1.5x, streaming slowed the decode 1.25x
    assert link.slowdown_while_computing == pytest.approx(1.5, rel=1e-3)
    assert profile.compute.slowdown_while_loading == pytest.approx(1.25, rel=1e-3)
    assert profile.tiers[0].capacity_bytes == 24 * 2**30
    # computing in the stored dtype: the roofline's memory rate is the measured one, not halved
    assert profile.compute.roofline.memory_bandwidth_bytes_per_s == pytest.approx(cpu.memory_bandwidth, rel=1e-3)
    # the host computes in the dtype of the hidden states it is sent, the GPU's float16: its weights are read
    # as 2-byte values, the stored bytes (the simulator's unit), so the rate is the measured read
    assert profile.host.roofline.memory_bandwidth_bytes_per_s == pytest.approx(cpu.host_memory_bandwidth,
                                                                               rel=1e-3)
    hosted = dataclasses.replace(cuda, host_link_seconds=9216 / 4e9, host_budget_bytes=2**30,
                                 capacities={"gpu": 24 * 2**30, "host": 2**30, "ssd": 2 * 10**12},
                                 capacity_notes={"gpu": "free", "host": "budget", "ssd": "disk"})
    profile = HardwareProfile.from_dict(measure.profile_dict(hosted))
    assert [link.name for link in profile.links] == ["host->gpu", "ssd->host"]
    assert profile.link_from(1).bandwidth_bytes_per_s == 25e9
    assert profile.link_from(2).bandwidth_bytes_per_s == pytest.approx(4e9, rel=1e-3)


def test_keeping_the_page_cache_is_recorded(packed):
    profile = measure.measure_hardware(packed / "packed", device="cpu", bypass_page_cache=False, **FAST)
    assert "page cache kept" in " ".join(profile["sources"])


def test_the_toml_writer_round_trips_the_dict(measured, tmp_path):
    path = write_profile(measured, tmp_path / "profile.toml", header="a header\non two lines")
    assert tomllib.loads(path.read_text()) == measured
    loaded = load_profile(path)
    assert dataclasses.replace(loaded, path="<memory>") == HardwareProfile.from_dict(measured, default_name="x")


def test_the_toml_writer_escapes_strings(tmp_path):
    odd = {"name": "odd", "description": 'quote " backslash \\ tab \t newline \n unicode é', "sources": ["a\\b"],
           "tiers": [{"name": "gpu", "capacity_bytes": 10}],
           "compute": {"expert": {"fixed_s": 1e-05, "per_token_s": 0.0}, "attention": {"fixed_s": 1.0},
                       "router": {"fixed_s": 0.0}, "lm_head": {"fixed_s": 2.5e-300, "per_token_s": 3.0}}}
    assert tomllib.loads(profile_toml(odd, header="# not a key")) == odd


def roofline_of(measurements, expert_seconds: dict, memory_bandwidth: float):
    """The roofline fitted to an expert of 1,000 stored bytes (500 float16 parameters) computed in float32."""
    m = dataclasses.replace(measurements, expert_bytes=1000, expert_params=500, compute_dtype="float32",
                            memory_bandwidth=memory_bandwidth, expert_seconds=expert_seconds)
    return HardwareProfile.from_dict(measure.profile_dict(m)).compute.roofline


def test_the_expert_roofline_passes_through_the_one_token_time(raw_measurements):
    """Hand-computed: the streaming read gives 2e6 float32 bytes/s = 1e6 stored bytes/s, so the memory term
    is 1 ms. A GPU-like expert, flat at 1.2 ms: all memory-bound, the overhead is 0.2 ms. A CPU-like one
    whose weights stay in the cache (0.5 ms at one token, below the 1 ms the streaming read predicts) and
    compute-bound from 4 tokens at 0.25 ms a token: the memory rate becomes the one-token rate (2e6 stored
    bytes/s), no overhead, 2 * 500 / 0.25 ms = 4e6 FLOP/s; it is exact at one token and at 64."""
    measurements = raw_measurements
    flat = roofline_of(measurements, {n: 1.2e-3 for n in measure.TOKEN_COUNTS}, 2e6)
    assert flat.memory_bandwidth_bytes_per_s == pytest.approx(1e6, rel=1e-3)
    assert flat.expert_overhead_s == pytest.approx(0.2e-3, rel=1e-3)
    assert flat.expert_seconds(1, 1000) == pytest.approx(1.2e-3, rel=1e-3)
    cached = roofline_of(measurements, {1: 0.5e-3, 2: 0.55e-3, 4: 1e-3, 8: 2e-3, 16: 4e-3, 32: 8e-3, 64: 16e-3}, 2e6)
    assert cached.memory_bandwidth_bytes_per_s == pytest.approx(2e6, rel=1e-3)
    assert cached.expert_overhead_s == 0
    assert cached.flops_per_s == pytest.approx(4e6, rel=1e-3)
    assert cached.expert_seconds(1, 1000) == pytest.approx(0.5e-3, rel=1e-3)
    assert cached.expert_seconds(64, 1000) == pytest.approx(16e-3, rel=1e-3)


def test_a_flat_expert_is_held_to_the_machines_peak(raw_measurements):
    """Times flat within noise: the slope over tokens is ~0 and the fitted rate absurd (2 * 500 FLOP / 1e-12 s
    = 1e15 FLOP/s); on a machine whose peak is 8e9 FLOP/s the roofline holds 8e9 and a note says why."""
    m = dataclasses.replace(raw_measurements, expert_bytes=1000, expert_params=500, compute_dtype="float32",
                            memory_bandwidth=2e6, expert_seconds={n: 1.2e-3 for n in measure.TOKEN_COUNTS},
                            peak_flops=8e9, peak_flops_how="a test machine", repeats=5, load_average=0.0, cores=2,
                            expert_deviation={1: 0.02}, link_deviation=0.01)
    roof = HardwareProfile.from_dict(measure.profile_dict(m)).compute.roofline
    assert roof.flops_per_s == pytest.approx(8e9)
    assert roof.expert_seconds(1, 1000) == pytest.approx(1.2e-3, rel=1e-3)  # still through the one-token time
    notes = measure.measurement_notes(m)
    assert len(notes) == 1 and "above this machine's peak of 8 GFLOP/s (a test machine)" in notes[0]
    assert any("holds the peak" in source for source in measure.profile_dict(m)["sources"])
    steady = dataclasses.replace(m, expert_seconds={n: 1e-3 + n * 1e-4 for n in measure.TOKEN_COUNTS})
    assert measure.measurement_notes(steady) == []  # 2 * 500 / 1e-4 = 1e7 FLOP/s: possible, stable, idle


def test_linear_fits_never_go_negative():
    assert measure.fit_linear_cost([1, 2, 4], [1.0, 2.0, 4.0]) == pytest.approx((0.0, 1.0))
    assert measure.fit_linear_cost([1, 2, 4], [3.0, 2.0, 1.0]) == pytest.approx((2.0, 0.0))  # flat: the mean
    fixed, per_token = measure.fit_linear_cost([1, 2, 4], [0.0, 1.0, 3.0])  # through the origin
    assert fixed == 0 and per_token > 0
    latency, bandwidth = measure.fit_latency_bandwidth(100, 2.0, 3.5)  # a stream of 2 s each, one alone 3.5 s
    assert latency == 1.5 and bandwidth == 50.0
    assert measure.fit_latency_bandwidth(100, 2.0, 1.0) == (0.0, 50.0)  # alone faster than the stream: no latency


def test_the_command_writes_a_profile_that_simulate_runs(packed, tmp_path, capsys, monkeypatch):
    made = []
    original = measure.profile_dict
    monkeypatch.setattr(measure, "profile_dict", lambda *a, **k: made.append(original(*a, **k)) or made[-1])
    output = tmp_path / "here.toml"
    assert main(["hardware", "measure", "--model", str(packed / "packed"), "-o", str(output), "--repeats", "1",
                 "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "link ssd->host" in out and str(output) in out
    import re
    assert re.search(r"\d (KiB|MiB|GiB)/s", out) and not re.search(r"\d (kB|MB|GB)\b", out)  # one unit family
    assert "+-" in out and "load average up to" in out  # each timing's spread, how busy the machine was
    profile = load_profile(output)
    assert profile.name == "here"
    assert dataclasses.replace(profile, path="<memory>") == HardwareProfile.from_dict(made[0])
    assert all(r > 0 and math.isfinite(r) for r in rates(profile))

    # the bundled default trace (OLMoE) on the measured machine; a small cache so that any RAM holds it
    assert main(["simulate", "--timed", "--hardware", str(output), "--cache-size", "32", "--jobs", "1"]) == 0
    assert "ssd->host" in capsys.readouterr().out


def test_an_unpacked_checkpoint_is_packed_first(packed, tmp_path, capsys):
    output = tmp_path / "checkpoint.toml"
    assert main(["hardware", "measure", "--model", str(packed / "model"), "-o", str(output), "--repeats", "1",
                 "--threads", "1"]) == 0
    assert load_profile(output).links[0].bandwidth_bytes_per_s > 0
    assert str(packed / "model") in " ".join(load_profile(output).sources)  # named as given, not the temporary pack


def test_the_bundled_model_is_packed_once_into_the_cache(packed, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("moe_offload.models.tiny.TINY_MODEL_DIR", packed / "model")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("MOE_OFFLOAD_CACHE", raising=False)
    for run in range(2):
        assert main(["hardware", "measure", "-o", str(tmp_path / "tiny.toml"), "--repeats", "1",
                     "--threads", "1"]) == 0
        packing = "(once)" in capsys.readouterr().err
        assert packing == (run == 0)  # the second run reuses the pack
    assert [p.name[:6] for p in (tmp_path / "cache" / "moe-offload" / "packed").iterdir()] == ["model-"]
    assert load_profile(tmp_path / "tiny.toml").name == "tiny"


def test_a_missing_bundled_model_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("moe_offload.models.tiny.TINY_MODEL_DIR", tmp_path / "absent")
    assert main(["hardware", "measure", "--model", "tiny", "-o", str(tmp_path / "p.toml")]) == 2
    assert "bundled model is missing" in capsys.readouterr().err


@pytest.mark.parametrize("model, problem", [("missing", "no such model directory"),
                                            ("empty", "not a model"),
                                            ("file.txt", "not a directory")])
def test_bad_models_are_one_line_errors(tmp_path, capsys, model, problem):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    assert main(["hardware", "measure", "--model", str(tmp_path / model), "-o", str(tmp_path / "p.toml")]) == 2
    err = capsys.readouterr().err
    assert problem in err and str(tmp_path / model) in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p.toml").exists()


def test_bad_options_are_one_line_errors(packed, tmp_path, capsys):
    assert main(["hardware", "measure", "--model", str(packed / "packed"), "--repeats", "0"]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err
    assert main(["hardware", "measure", "--model", str(packed / "packed"), "-o", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
