"""The runtime: packing, lossless generation under every online policy, prefetcher and budget, faults,
concurrency and the counters, on a tiny random Mixtral packed in a temporary directory."""

import errno
import os
import re
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from model_configs import build, tiny_tokenizer  # noqa: E402

from moe_offload.cli.main import main  # noqa: E402
from moe_offload.errors import ConfigError  # noqa: E402
from moe_offload.models.recorder import record  # noqa: E402
from moe_offload.policies import POLICIES, default_policies  # noqa: E402
from moe_offload.plan import make_plan  # noqa: E402
from moe_offload.runtime.engine import EngineBusyError, OffloadEngine  # noqa: E402
from moe_offload.runtime.packing import PackError, pack_model, read_manifest  # noqa: E402
from moe_offload.runtime.skeleton import load_skeleton  # noqa: E402
from moe_offload.runtime.storage import ExpertReadError, ExpertStore  # noqa: E402
from moe_offload.text.prompts import Prompt  # noqa: E402

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog."]
NEW_TOKENS = 6
COMPUTE_EXPERT_BYTES = (2 * 48 * 32 + 32 * 48) * 4  # one expert of the test model in float32
# the placing policies (static placements computing misses on the host, pinned sets) have their own tests:
# tests/test_runtime_bypass.py
ONLINE_POLICIES = sorted(name for name in default_policies()
                         if not POLICIES[name].offline and not POLICIES[name].policy.places_or_bypasses)
PREFETCHERS = [None, "topk", "traced-topk", "moe-infinity", "fmoe", "moepic", "mixtral-offloading"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Mixtral saved in float16 with a tokenizer, its pack, references and a history trace."""
    root = tmp_path_factory.mktemp("runtime")
    model, adapter = build("mixtral", seed=3)
    model.half().save_pretrained(root / "model")
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(root / "model")
    pack_model(root / "model", root / "packed")
    from moe_offload.models.adapters import load_model

    reference, ref_adapter = load_model(root / "model")  # all-resident, float32, eager experts
    expected = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                     do_sample=False, return_dict_in_generate=True, output_logits=True,
                                     pad_token_id=0)
        expected[prompt] = (out.sequences[0, ids.shape[1]:].tolist(), [step[0] for step in out.logits])
    history = record(reference, ref_adapter, tokenizer, [Prompt(p, f"h:{i}") for i, p in enumerate(PROMPTS * 2)],
                     model_name="tiny-random", max_new_tokens=4, batch_size=2).trace
    return Checkpoint(root=root, packed=root / "packed", expected=expected, history=history)


class Checkpoint(dict):
    def __repr__(self):  # hypothesis prints its arguments on failure: keep it short
        return f"Checkpoint({self['root']})"


def assert_lossless(engine, checkpoint):
    for prompt, (tokens, logits) in checkpoint["expected"].items():
        result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, return_logits=True)
        assert result.token_ids == tokens
        assert all(torch.equal(a, b) for a, b in zip(result.logits, logits))
        stats = result.stats
        assert stats.hits + stats.misses + (stats.bypassed or 0) == stats.accesses > 0


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=st.sampled_from(ONLINE_POLICIES), prefetch=st.sampled_from(PREFETCHERS),
       budget=st.integers(min_value=2, max_value=18), host=st.sampled_from([None, "40%", "100%"]))
def test_generation_is_lossless_for_every_policy_prefetcher_and_budget(checkpoint, policy, prefetch, budget, host):
    assume(budget >= 3 or not POLICIES[policy].partitioned)  # a -dist cache gives each of the 3 layers a slot
    history = checkpoint["history"] if prefetch in ("moe-infinity", "fmoe") else None
    fast = f"{budget * COMPUTE_EXPERT_BYTES}B"  # 18 experts in all (3 layers x 6); top-2 is the least that works
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget=fast, policy=policy, prefetch=prefetch,
                                 prefetch_history=history, host_budget=host)) as engine:
        assert_lossless(engine, checkpoint)


def test_counters_without_prefetch_and_all_resident(checkpoint):
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget="34%", policy="lru")) as engine:
        result = engine.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
        stats = result.stats
        assert stats.on_demand_loads == stats.misses > 0
        assert stats.bytes_per_link == {"ssd->fast": stats.misses * engine.manifest.expert_bytes}
        assert stats.prefetches_issued is None and stats.stall_seconds >= 0
        assert engine.stats.accesses == stats.accesses
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget="100%", preload=True)) as engine:
        stats = engine.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS).stats
        assert stats.hit_rate == 1.0 and stats.on_demand_loads == 0 and not stats.bytes_per_link


def test_the_policys_decisions_are_counted_and_timed(checkpoint):
    # every eviction of the fast tier is one victim call, timed around the call (simulator/cache.py: Decisions)
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget="34%", policy="learned")) as engine:
        stats = engine.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS).stats
        assert stats.policy_decisions == engine.tiers[0].cache.evictions > 0
        assert 0 < stats.policy_decision_seconds < stats.total_seconds
        assert engine.stats.policy_decisions == stats.policy_decisions


@pytest.mark.parametrize("budget, prefetch", [(2, None), (5, "topk"), (9, None)])
def test_coact_is_lossless_and_its_decisions_are_counted(checkpoint, budget, prefetch):
    # the project's own policy (policies/coact.py) as a user runs it: the tokens and logits of all-resident
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget=f"{budget * COMPUTE_EXPERT_BYTES}B", policy="coact",
                                 prefetch=prefetch)) as engine:
        assert_lossless(engine, checkpoint)
        assert engine.stats.policy_decisions == engine.tiers[0].cache.evictions > 0


def test_a_dist_cache_holding_a_layer_whole_loads_it_first_and_stays_lossless(checkpoint):
    # 3 layers of 6 experts, room for 10: layer 2 whole from the start (6), layers 0 and 1 an LRU of 2 each
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget=f"{10 * COMPUTE_EXPERT_BYTES}B",
                                 policy="lru-dist", policy_options={"whole_layers": [2]})) as engine:
        assert engine.preload_seconds > 0 and len(engine.tiers[0].cache.parts[2]) == 6
        assert_lossless(engine, checkpoint)
        stats = engine.stats
        assert stats.per_layer_hits[2] == stats.per_layer_accesses[2] > 0
        assert stats.per_layer_hits[0] < stats.per_layer_accesses[0]
        assert engine.tiers[0].cache.parts[2].evictions == 0


def test_packing_layout_and_skeleton(checkpoint):
    manifest = read_manifest(checkpoint["packed"])
    assert (manifest.num_layers, manifest.num_experts, manifest.top_k) == (3, 6, 2)
    assert manifest.expert_bytes == (2 * 48 * 32 + 32 * 48) * 2  # float16
    assert [t.name for t in manifest.tensors] == ["gate_up_proj", "down_proj"]
    assert [t.shape for t in manifest.tensors] == [(96, 32), (32, 48)]
    assert all(os.path.getsize(manifest.layer_path(l)) == 6 * 12288 for l in range(3))  # 9216 B -> 3 pages
    assert {e.offset for e in manifest.experts.values()} == {i * 12288 for i in range(6)}
    from moe_offload.runtime.storage import ExpertStore
    read = ExpertStore(manifest).read_tensors(1, 4)
    adapter_ = build("mixtral", seed=3)[1]
    for name, tensor in read.items():
        assert torch.equal(tensor, adapter_.expert_tensors(1, 4)[name].half())
    model, adapter, seconds = load_skeleton(manifest)
    assert seconds > 0
    assert all(adapter.experts(layer).gate_up_proj.numel() == 0 for layer in range(adapter.num_layers))


def test_the_skeleton_in_float16_has_from_pretrained_s_buffers_and_weights(checkpoint):
    # from_pretrained keeps rotary frequencies in float32 whatever the weights' dtype; casting them with the
    # weights changed the float16 engine's tokens on CUDA against transformers' with the same experts function
    from moe_offload.models.adapters import load_model

    skeleton, _, _ = load_skeleton(read_manifest(checkpoint["packed"]), dtype=torch.float16)
    model, _ = load_model(checkpoint["root"] / "model", dtype=torch.float16)
    buffers = dict(skeleton.named_buffers())
    assert buffers and all(torch.equal(buffers[name], buffer) and buffers[name].dtype == buffer.dtype
                           for name, buffer in model.named_buffers())
    weights = dict(skeleton.named_parameters())
    assert all(torch.equal(weights[name], p) for name, p in model.named_parameters() if weights[name].numel())


def test_refusals(checkpoint):
    packed = checkpoint["packed"]
    with pytest.raises(ConfigError, match="cannot hold one layer's top-2 experts"):
        OffloadEngine(make_plan(packed, fast_budget="5%"))
    with pytest.raises(ConfigError, match="leave a layer without one"):
        OffloadEngine(make_plan(packed, fast_budget=f"{2 * COMPUTE_EXPERT_BYTES}B", policy="lru-dist"))
    with pytest.raises(ConfigError, match="cannot hold 2 whole layers of 6 experts and one expert in each of the "
                                          "other 1 layers"):
        OffloadEngine(make_plan(packed, fast_budget=f"{12 * COMPUTE_EXPERT_BYTES}B", policy="lru-dist",
                                policy_options={"whole_layers": [0, 1]}))
    with pytest.raises(ConfigError, match="needs the future"):
        OffloadEngine(make_plan(packed, policy="belady"))
    with pytest.raises(ConfigError, match="chooses its experts from a profile"):
        OffloadEngine(make_plan(packed, policy="static-freq"))
    with pytest.raises(ConfigError, match="nothing for the prefetcher 'topk' to prefetch"):
        OffloadEngine(make_plan(packed, policy="static-layers", prefetch="topk"))
    with pytest.raises(ConfigError, match="reads the future"):
        OffloadEngine(make_plan(packed, prefetch="oracle"))
    with pytest.raises(ConfigError, match="give it a history"):
        OffloadEngine(make_plan(packed, prefetch="moe-infinity"))


def copy_pack(checkpoint, tmp_path):
    import shutil

    target = tmp_path / "packed"
    shutil.copytree(checkpoint["packed"], target)
    return target, read_manifest(target)


def test_missing_and_truncated_layer_files_are_named_at_start(checkpoint, tmp_path):
    packed, manifest = copy_pack(checkpoint, tmp_path)
    victim = manifest.layer_path(1)
    data = victim.read_bytes()
    victim.write_bytes(data[:-10])
    with pytest.raises(PackError, match=r"experts of layer 1: .*layer001.bin: \d+ bytes, the manifest says"):
        OffloadEngine(make_plan(packed))
    victim.unlink()
    with pytest.raises(PackError, match=r"experts of layer 1: .*layer001.bin: missing"):
        OffloadEngine(make_plan(packed))


def test_checksum_mismatch_stops_generation_before_a_wrong_token(checkpoint, tmp_path):
    packed, manifest = copy_pack(checkpoint, tmp_path)
    victim = manifest.layer_path(0)
    data = bytearray(victim.read_bytes())
    data[manifest.expert_bytes - 3] ^= 0xFF  # same size, one weight byte of expert 0 flipped
    victim.write_bytes(bytes(data))
    streamed = []
    with OffloadEngine(make_plan(packed, fast_budget="100%", policy="lru")) as engine:
        with pytest.raises(ExpertReadError, match=r"expert 0 of layer 0: .*layer000.bin \(bytes 0..9216\): checksum "
                                                  "mismatch"):
            for prompt in PROMPTS * 3:  # some prompt routes to expert 0 of layer 0
                engine.generate(prompt, max_new_tokens=NEW_TOKENS, on_text=streamed.append)


def test_a_chunk_changed_after_its_first_verified_read_is_caught_by_the_fast_checksum(checkpoint, tmp_path):
    packed, manifest = copy_pack(checkpoint, tmp_path)
    store = ExpertStore(manifest)
    store.read_tensors(0, 0)  # SHA-256 checked: later reads check xxHash3
    victim = manifest.layer_path(0)
    with open(victim, "r+b") as handle:  # in place: the same file (inode), as a failing disk would
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(bytes([byte[0] ^ 1]))
    stat = os.stat(victim)
    os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(ExpertReadError, match="checksum mismatch"):
        store.read_tensors(0, 0)
    store.close()


class FlakyReader:
    """os.preadv that fails with ``error`` the first ``failures`` times."""

    def __init__(self, failures, error=errno.EIO):
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self, fd, view, offset):
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError(self.error, os.strerror(self.error))
        return os.preadv(fd, [view], offset)


def test_transient_read_errors_are_retried(checkpoint):
    manifest = read_manifest(checkpoint["packed"])
    store = ExpertStore(manifest, read_into=FlakyReader(2), backoff_s=0.0)
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget="50%"), store=store) as engine:
        assert_lossless(engine, checkpoint)
    assert store.retried == 2


def test_persistent_read_errors_name_the_expert_and_file(checkpoint):
    manifest = read_manifest(checkpoint["packed"])
    store = ExpertStore(manifest, read_into=FlakyReader(10 ** 6), retries=2, backoff_s=0.0)
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget="50%"), store=store) as engine:
        with pytest.raises(ExpertReadError, match=r"expert \d+ of layer \d+: .*\.bin \(bytes \d+..\d+\): read failed "
                                                  "after 3"):
            engine.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)


def test_short_reads_are_continued(checkpoint):
    manifest = read_manifest(checkpoint["packed"])
    store = ExpertStore(manifest, read_into=lambda fd, view, offset: os.preadv(fd, [view[:1000]], offset))
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget="50%"), store=store) as engine:
        assert_lossless(engine, checkpoint)


def test_concurrent_generate_is_refused(checkpoint):
    manifest = read_manifest(checkpoint["packed"])
    release = threading.Event()
    reading = threading.Event()

    def blocking_read(fd, view, offset):
        reading.set()
        release.wait(10)
        return os.preadv(fd, [view], offset)

    store = ExpertStore(manifest, read_into=blocking_read)
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget="50%"), store=store) as engine:
        first = threading.Thread(target=engine.generate, args=(PROMPTS[0],), kwargs={"max_new_tokens": 2})
        first.start()
        assert reading.wait(10)
        with pytest.raises(EngineBusyError, match="already generating"):
            engine.generate(PROMPTS[1], max_new_tokens=2)
        release.set()
        first.join(10)
        assert not first.is_alive()
        engine.generate(PROMPTS[1], max_new_tokens=2)  # free again


def test_pack_and_generate_commands(checkpoint, tmp_path, capsys):
    import json

    assert main(["pack", str(checkpoint["root"] / "model"), "-o", str(tmp_path / "p")]) == 0
    assert "start-up" in capsys.readouterr().out
    assert main(["generate", "--model", str(tmp_path / "p"), "--fast-budget", "40%", "--policy", "lfu",
                 "--prefetch", "topk", "--max-new-tokens", "4", "--json", str(tmp_path / "r.json"), PROMPTS[0]]) == 0
    out = capsys.readouterr().out
    assert out.startswith(PROMPTS[0]) and "tokens/s" in out and "prefetch precision" in out
    assert re.search(r"eviction decisions +│ +\d+ in \d+\.\d\d ms", out)
    record_ = json.loads((tmp_path / "r.json").read_text())
    assert record_["policy"] == "lfu" and record_["prefetcher"] == "topk"
    tokens, _ = checkpoint["expected"][PROMPTS[0]]
    assert record_["token_ids"] == tokens[:4] and record_["prompt"] == PROMPTS[0]
    assert out.startswith(PROMPTS[0] + record_["text"]) and record_["prompt_tokens"] > 0
    assert main(["generate", "--model", str(tmp_path / "p"), "--fast-budget", "1%", "x"]) == 2
    assert "cannot hold one layer's top-2" in capsys.readouterr().err
    assert main(["pack", str(tmp_path / "nothing"), "-o", str(tmp_path / "q")]) == 2


def test_python_api(checkpoint):
    import moe_offload

    engine = moe_offload.load(str(checkpoint["packed"]), fast_budget="50%", policy="lru", prefetch="moepic")
    with engine:
        assert_lossless(engine, checkpoint)
        assert engine.stats.accesses > 0
        assert np.isfinite(engine.startup_seconds)


def test_moepic_prefetches_layer_0_of_the_next_token_after_the_last_layer(checkpoint, monkeypatch):
    """Paper 004: router 0 on the last layer's hidden state predicts layer 0 of the next token; the runtime
    computes that prediction and queues its prefetches, as the timed simulator does."""
    import moe_offload
    from moe_offload.runtime.datapath import DataPath

    queued = []
    route = DataPath.route

    def recording_route(self, key, demand, priority):
        queued.append((int(key), demand, self.layer_now))
        return route(self, key, demand, priority)

    monkeypatch.setattr(DataPath, "route", recording_route)
    engine = moe_offload.load(str(checkpoint["packed"]), fast_budget="25%", policy="lru", prefetch="moepic")
    with engine:
        assert_lossless(engine, checkpoint)
        layers, experts = engine.spec.num_layers, engine.spec.num_experts
    next_token = [key for key, demand, now in queued if not demand and now == layers - 1]
    assert next_token and all(key // experts == 0 for key in next_token)


def test_the_unsplit_runtime_gives_moepic_the_timed_simulators_y(checkpoint):
    """Issue 25: without a split, the runtime's MoEpic prefetcher gets the link budget of the hardware profile, as
    ``simulate --timed`` gives it, so both propose the same experts for the same routing."""
    from moe_offload.hardware import resolve_profile
    from moe_offload.policies import ModelSpec
    from moe_offload.prefetch import RoutingView, make_prefetcher
    from moe_offload.prefetch.budget import budget_from_hardware
    from moe_offload.simulator.timed import simulate_timed

    hardware = resolve_profile("server-h100-pcie5")
    trace = checkpoint["history"]
    manifest = read_manifest(checkpoint["packed"])
    expert_bytes = manifest.expert_bytes
    simulated = make_prefetcher("moepic", ModelSpec(manifest.num_layers, manifest.num_experts, manifest.top_k))
    simulate_timed(trace, hardware, "lru", 6 * expert_bytes, expert_bytes=expert_bytes, prefetcher=simulated)
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget="50%", prefetch="moepic", hardware=hardware)) as engine:
        running = engine.prefetcher
        L = engine.spec.num_layers
        # by hand: window / load on this profile, at most J = 6; layer 0's window has the LM head in it
        budget = running.budget
        assert budget.window_seconds == simulated.budget.window_seconds
        assert budget.expert_load_seconds == simulated.budget.expert_load_seconds
        assert [running.prefetches_for(layer) for layer in range(L)] == [
            min(6, int(window // budget.expert_load_seconds)) for window in budget.window_seconds] == [6, 5, 5]
        most = 0
        for iteration in np.unique(trace.iteration):
            view = RoutingView(trace, int(iteration), np.flatnonzero(trace.iteration == iteration))
            for layer in range(L):
                view.layer_now = layer
                proposed = running.on_layer_routed(view)
                assert proposed == simulated.on_layer_routed(view)
                most = max(most, len(proposed))
        assert most > manifest.top_k  # Y, not top-k, reached the proposals
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget="50%", prefetch="moepic")) as engine:  # the default profile
        assert engine.prefetcher.budget == budget_from_hardware(resolve_profile(None), expert_bytes, L, manifest.top_k)


def test_llru_counts_the_replays_rounds_in_the_runtime(checkpoint, monkeypatch):
    """The clock LLRU reads for each runtime access, round * L + layer, is the replay's clock of the first
    request of that expert in the pass (K rounds per token), as in the timed simulator."""
    from llru_clocks import first_request_clocks, spy_on_llru
    from moe_offload.models.adapters import load_model

    seen = spy_on_llru(monkeypatch)
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget=f"{6 * COMPUTE_EXPERT_BYTES}B", policy="test-llru")) as engine:
        engine.generate(PROMPTS[1], max_new_tokens=3)
    reference, adapter = load_model(checkpoint["root"] / "model")
    trace = record(reference, adapter, tiny_tokenizer(), [Prompt(PROMPTS[1], "p")], model_name="tiny-random",
                   max_new_tokens=3, batch_size=1).trace
    expected = first_request_clocks(trace, [(iteration, np.flatnonzero(trace.iteration == iteration))
                                            for iteration in np.unique(trace.iteration)])
    assert len(np.unique(trace.iteration)) == 3  # the prompt's pass, then two one-token passes
    assert seen == expected


# ------------------------------------------------------------------------------------ hostile input (issue 11)
def one_line_error(capsys) -> str:
    """The one error line of a failed command (a progress note such as "packing ... (once)" may precede it)."""
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_a_truncated_checkpoint_is_a_one_line_error_for_pack_and_generate(checkpoint, tmp_path, capsys,
                                                                          monkeypatch):
    import shutil

    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    shutil.copytree(checkpoint["root"] / "model", model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    assert main(["pack", str(model), "-o", str(tmp_path / "p")]) == 2
    assert "cannot be loaded" in one_line_error(capsys) and not (tmp_path / "p").exists()
    assert main(["generate", "--model", str(model), "x"]) == 2
    assert "cannot be loaded" in one_line_error(capsys)
    assert not list((tmp_path / "cache" / "packed").glob("model-*")), "a half-written pack was left in the cache"


@pytest.mark.parametrize("device, problem", [("mps", "is not a device: cpu, cuda or cuda:N"),
                                             ("nonsense", "is not a device"),
                                             ("cuda:7", "has no CUDA device; use cpu" if not torch.cuda.is_available()
                                              else "CUDA device(s)")])
def test_unknown_or_unavailable_devices_are_one_line_errors(checkpoint, capsys, device, problem):
    assert main(["generate", "--model", str(checkpoint["packed"]), "--device", device, "x"]) == 2
    assert problem in one_line_error(capsys)
    assert main(["hardware", "measure", "--model", str(checkpoint["packed"]), "--device", device]) == 2
    assert problem in one_line_error(capsys)


def test_prompts_and_generations_longer_than_the_context_are_refused(checkpoint, capsys):
    context = read_manifest(checkpoint["packed"]).max_position_embeddings  # 256 in the test model
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget="100%")) as engine:
        with pytest.raises(ConfigError, match=f"the prompt has {context + 1} tokens, more than the model's context"):
            engine.generate(list(range(1, context + 2)), max_new_tokens=1)
        with pytest.raises(ConfigError, match=f"exceed the model's context of {context}: ask for at most 6"):
            engine.generate(list(range(1, context - 5)), max_new_tokens=7)
        assert len(engine.generate(list(range(1, context - 5)), max_new_tokens=6).token_ids) == 6
    capsys.readouterr()
    assert main(["generate", "--model", str(checkpoint["packed"]), "--max-new-tokens", "1000", "hi"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before the prompt is echoed
    assert "exceed the model's context of 256" in captured.err and "Traceback" not in captured.err
    # a count that is none is refused before the model is even looked for
    assert main(["generate", "--model", "/no/such/model", "--max-new-tokens", "0", "hi"]) == 2
    assert "--max-new-tokens 0: must be a whole number of at least 1" in one_line_error(capsys)


def test_generate_threads_are_checked_first_and_set_for_the_process(checkpoint, capsys):
    import torch

    from moe_offload.values import cores

    for bad in ("0", "x", str(cores() + 1)):
        assert main(["generate", "--model", "/no/such/model", "--threads", bad, "hi"]) == 2
        assert "--threads" in one_line_error(capsys)
    before = torch.get_num_threads()
    try:
        assert main(["generate", "--model", str(checkpoint["packed"]), "--threads", "1", "--max-new-tokens", "2",
                     "hi"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_engine_loads_on_one_thread_and_leaves_the_thread_count_as_it_was(checkpoint, monkeypatch):
    """runtime/cpu_threads.py: the model loads with one PyTorch thread (no OpenMP team for the loading thread)
    and the count is as it was afterwards, also when construction fails; a copy in pieces equals one copy."""
    import torch

    import moe_offload.runtime.engine as engine_module
    from moe_offload.runtime.cpu_threads import copy_serially

    before, seen = torch.get_num_threads(), []
    load_skeleton = engine_module.load_skeleton

    def counting(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return load_skeleton(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_skeleton", counting)
    OffloadEngine(make_plan(checkpoint["packed"], fast_budget="100%")).close()
    assert seen == [1] and torch.get_num_threads() == before
    with pytest.raises(ConfigError):
        OffloadEngine(make_plan(checkpoint["packed"], fast_budget="100%", policy="belady"))
    assert torch.get_num_threads() == before
    source = torch.arange(100_000, dtype=torch.float16) / 7
    destination = torch.empty(100_000)
    copy_serially(destination, source)
    assert torch.equal(destination, source.float())


def test_the_computing_thread_takes_the_callers_count_whatever_a_worker_set_for_itself(checkpoint):
    """runtime/cpu_threads.py: a thread started while another is inside single_threaded would compute with one
    thread (and other bits) for its life; the scheduler's thread sets the count the engine was built with."""
    import torch

    from moe_offload.runtime.cpu_threads import single_threaded

    before = torch.get_num_threads()
    inside, leave = threading.Event(), threading.Event()

    def worker():
        with single_threaded():
            inside.set()
            leave.wait(30)

    torch.set_num_threads(2)
    try:
        with OffloadEngine(make_plan(checkpoint["packed"], fast_budget="100%")) as engine:
            helper = threading.Thread(target=worker)
            helper.start()
            assert inside.wait(30)
            try:
                naive = []  # what any new thread gets now: the count the worker set
                probe = threading.Thread(target=lambda: naive.append(torch.get_num_threads()))
                probe.start()
                probe.join()
                assert naive == [1]
                assert engine.scheduler.run(torch.get_num_threads) == 2
            finally:
                leave.set()
                helper.join()
    finally:
        torch.set_num_threads(before)


def test_a_count_a_thread_sets_for_itself_holds_whatever_another_thread_sets_before_its_first_operation():
    """runtime/cpu_threads.py: PyTorch gives a thread, at its first parallel operation, the count any thread set
    last, over the count it set itself; set_thread_count holds."""
    import torch

    from moe_offload.runtime.cpu_threads import set_thread_count

    def counts(setter):
        set_, other_set, seen = threading.Event(), threading.Event(), []

        def computing():
            setter(2)
            set_.set()
            assert other_set.wait(30)
            torch.ones(1 << 16).add_(1)  # over PyTorch's grain: a parallel operation
            seen.append(torch.get_num_threads())

        thread = threading.Thread(target=computing)
        thread.start()
        assert set_.wait(30)
        other = threading.Thread(target=lambda: (torch.get_num_threads(), torch.set_num_threads(1)))
        other.start()
        other.join()
        other_set.set()
        thread.join()
        return seen

    before = torch.get_num_threads()
    try:
        assert counts(torch.set_num_threads) == [1]  # PyTorch's own: the other thread's count wins
        assert counts(set_thread_count) == [2]
    finally:
        torch.set_num_threads(before)


def test_an_interrupted_pack_leaves_nothing_behind(checkpoint, tmp_path):
    calls = []

    def interrupt():
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pack_model(checkpoint["root"] / "model", tmp_path / "out", on_expert=interrupt)
    assert list(tmp_path.iterdir()) == []


def test_pack_refuses_a_bad_output_before_any_work(checkpoint, tmp_path, capsys, monkeypatch):
    import moe_offload.models.adapters as adapters

    monkeypatch.setattr(adapters, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "file").write_text("x")
    source = str(checkpoint["root"] / "model")
    assert main(["pack", source, "-o", str(tmp_path / "full")]) == 2
    assert "exists and is not empty" in one_line_error(capsys)
    assert main(["pack", source, "-o", str(tmp_path / "file" / "out")]) == 2
    assert "cannot be created" in one_line_error(capsys)


def test_generate_json_is_checked_first_and_written_atomically(checkpoint, tmp_path, capsys):
    import moe_offload.runtime.engine as engines

    target = tmp_path / "r.json"
    target.write_text("old")
    (tmp_path / "dir.json").mkdir()
    assert main(["generate", "--model", str(checkpoint["packed"]), "--json", str(tmp_path / "dir.json"), "x"]) == 2
    assert "is a directory" in one_line_error(capsys)
    assert main(["generate", "--model", str(checkpoint["packed"]), "--json", str(tmp_path / "r.txt"), "x"]) == 2
    assert "must end in .json" in one_line_error(capsys)
    original = engines.OffloadEngine

    def failing_engine(*args, **kwargs):
        engine = original(*args, **kwargs)
        engine.generate = lambda *a, **k: (_ for _ in ()).throw(ConfigError("injected failure"))
        return engine

    engines.OffloadEngine = failing_engine
    try:
        assert main(["generate", "--model", str(checkpoint["packed"]), "--json", str(target), "x"]) == 2
    finally:
        engines.OffloadEngine = original
    capsys.readouterr()
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["dir.json", "r.json"]


def test_hardware_measure_checks_its_output_first(checkpoint, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["hardware", "measure", "--model", str(checkpoint["packed"]), "-o",
                 str(tmp_path / "file" / "p.toml")]) == 2
    assert "cannot be created" in one_line_error(capsys)


# ------------------------------------------------------------------------------------------ routing replay
def test_replay_forces_every_router_to_the_traces_experts(checkpoint):
    from moe_offload.models.routing_tap import RoutingTap
    from moe_offload.runtime.replay import replay_rows

    trace = checkpoint["history"]
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget="100%", replay=trace, replay_weights="router")) as engine:
        seen = {layer: [] for layer in range(3)}
        with RoutingTap(engine.adapter, lambda layer, routing: seen[layer].append(routing.experts.cpu().numpy())):
            result = engine.generate_replayed(1)
    rows = replay_rows(trace, 1)
    assert len(result.token_ids) == len(rows) - int((trace.phase[rows] == 0).sum()) + 1
    for layer in range(3):
        assert np.array_equal(np.concatenate(seen[layer]), trace.experts[rows, layer])


def test_the_oracle_runs_under_replay_and_every_prefetch_is_used_whatever_the_policy(checkpoint):
    """The cache's hold rule in the runtime: a prefetched expert survives until its layer computes, so the
    oracle's precision is 100% under LRU, LCP (newcomers rank lowest) and fMoE alike when the budget holds
    what the oracle looks ahead at (3 layers x top-2 beside the 2 experts computing: 8 of 18); the tokens and
    logits are those of the all-resident replay. Decode steps only: a prefill needs more experts per layer
    than that, and a demand load may then release holds (simulator/cache.py)."""
    history = checkpoint["history"]
    decode = history.select(np.flatnonzero((history.request == history.request[0]) & (history.phase == 1)))
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget="100%", preload=True, replay=decode,
                                 replay_weights="router")) as engine:
        expected = engine.generate_replayed(0, return_logits=True)
    for policy in ("lru", "lcp", "fmoe"):
        with OffloadEngine(make_plan(checkpoint["packed"], fast_budget=f"{8 * COMPUTE_EXPERT_BYTES}B", policy=policy,
                                     prefetch="oracle", replay=decode, replay_weights="router")) as engine:
            result = engine.generate_replayed(0, return_logits=True)
        stats = result.stats
        assert result.token_ids == expected.token_ids
        assert all(torch.equal(a, b) for a, b in zip(result.logits, expected.logits))
        assert stats.prefetches_issued > 0 and stats.prefetches_used == stats.prefetches_issued, policy


def test_the_policy_sees_the_tokens_each_access_carries(checkpoint):
    from moe_offload.policies.lru import LRU

    seen = []

    class Spy(LRU):
        def on_access(self, key, ctx):
            seen.append((ctx.layer, dict(ctx.routed)))
            super().on_access(key, ctx)

    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget="100%")) as engine:
        engine.tiers[0].cache.policy = Spy(engine.spec)
        prompt_tokens = len(engine.tokenizer(PROMPTS[1])["input_ids"])
        engine.generate(PROMPTS[1], max_new_tokens=2)
    assert all(list(routed) == [0] for _, routed in seen)  # all from request 0
    assert any(routed[0] > 1 for _, routed in seen)  # the prefill's accesses carry several tokens
    # every token of the prompt and of the one decode step is routed to top-2 experts in every layer
    assert {layer: sum(r[0] for l, r in seen if l == layer) for layer in range(3)} == \
        {layer: 2 * (prompt_tokens + 1) for layer in range(3)}


@pytest.fixture(scope="module")
def expert_dtype_packs(checkpoint):
    """expert dtype -> (its pack, the reference tokens and logits of the all-resident float32 model whose experts
    are the very values that pack stores: cast to bfloat16, or quantized and dequantized by quantize.py)."""
    from model_configs import tiny_tokenizer as tokenizer_of

    from moe_offload.models.adapters import load_model
    from moe_offload.hardware.choices import QUANTIZED
    from moe_offload.runtime.quantize import dequantize, quantize

    tokenizer = tokenizer_of()
    packs = {}
    for expert_dtype in ("bfloat16", "int8", "int4"):
        packed = checkpoint["root"] / f"packed-{expert_dtype}"
        pack_model(checkpoint["root"] / "model", packed, expert_dtype=expert_dtype)
        reference, adapter = load_model(checkpoint["root"] / "model")
        with torch.no_grad():
            for layer in range(adapter.num_layers):
                module = adapter.experts(layer)
                for name in adapter.EXPERT_TENSORS:
                    weight = getattr(module, name)
                    for expert in range(adapter.num_experts):
                        w = weight[expert]
                        weight[expert] = (dequantize(quantize(w, expert_dtype), w.shape, expert_dtype, torch.float32)
                                          if expert_dtype in QUANTIZED else w.to(torch.bfloat16).float())
        expected = {}
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                out = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                         max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                                         output_logits=True, pad_token_id=0)
            expected[prompt] = (out.sequences[0, ids.shape[1]:].tolist(), [step[0] for step in out.logits])
        packs[expert_dtype] = (packed, expected)
    return packs


@pytest.mark.parametrize("expert_dtype", ["bfloat16", "int8", "int4"])
@pytest.mark.parametrize("policy, prefetch, budget", [("lru", None, 2), ("lfu", "topk", 5), ("arc", "moepic", 11)])
def test_generation_is_lossless_for_every_expert_dtype(checkpoint, expert_dtype_packs, expert_dtype, policy,
                                                       prefetch, budget):
    packed, expected = expert_dtype_packs[expert_dtype]
    manifest = read_manifest(packed)
    slot = manifest.expert_bytes if manifest.quantized else COMPUTE_EXPERT_BYTES
    with OffloadEngine(make_plan(packed, fast_budget=f"{budget * slot}B", policy=policy,
                                 prefetch=prefetch)) as engine:
        assert engine.tiers[0].pool.slots == budget  # quantized: the budget counts the stored bytes
        assert_lossless(engine, Checkpoint(expected=expected))


def test_a_budget_share_is_the_same_memory_and_holds_more_quantized_experts(checkpoint, expert_dtype_packs):
    # the test model's int4 expert: gate_up_proj [96, 32] in groups of 32, down_proj [32, 48] in groups of 16
    int4_expert = (96 * 32 // 2 + 96 * 1 * 2) + (32 * 48 // 2 + 32 * 3 * 2)
    assert read_manifest(expert_dtype_packs["int4"][0]).expert_bytes == int4_expert == 2688
    budget = 18 * COMPUTE_EXPERT_BYTES // 8  # 12.5% of the 18 experts in float32: 41472 bytes
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget="12.5%")) as engine:
        assert engine.tiers[0].pool.slots == budget // COMPUTE_EXPERT_BYTES == 2
    with OffloadEngine(make_plan(expert_dtype_packs["int4"][0], fast_budget="12.5%")) as engine:
        assert engine.tiers[0].pool.slots == budget // int4_expert == 15


def test_quantized_packs_refuse_what_does_not_read_them_in_one_line(checkpoint, expert_dtype_packs, tmp_path, capsys):
    packed = str(expert_dtype_packs["int8"][0])
    with pytest.raises(ConfigError, match="int8 experts: MoEpic's split does not read quantized experts yet"):
        OffloadEngine(make_plan(packed, fast_budget="50%", split_config=str(tmp_path / "never-read.json")))
    assert main(["generate", "--model", packed, "--expert-dtype", "int4", "x"]) == 2
    assert "packed with int8 experts, not int4" in capsys.readouterr().err
    assert main(["pack", str(checkpoint["root"] / "model"), "-o", str(tmp_path / "q"), "--expert-dtype", "int3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--expert-dtype 'int3': choose from" in err
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_compute_dtype_is_lossless_against_the_all_resident_engine_in_that_dtype(checkpoint, dtype):
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget="100%", preload=True, dtype=dtype, device="cpu")) as engine:
        assert engine.compute_dtype == getattr(torch, dtype) and engine.tiers[0].pool.memory.dtype == engine.compute_dtype
        expected = {}
        for prompt in PROMPTS:
            result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, return_logits=True)
            expected[prompt] = (result.token_ids, result.logits)
    with OffloadEngine(make_plan(checkpoint["packed"], fast_budget=f"{3 * COMPUTE_EXPERT_BYTES // 2}B", dtype=dtype,
                                 prefetch="topk", device="cpu")) as engine:
        assert engine.tiers[0].pool.slots == 3  # half the bytes of a float32 expert each
        assert_lossless(engine, Checkpoint(expected=expected))


def test_an_unknown_compute_dtype_is_one_line_before_any_work(checkpoint, capsys):
    assert main(["generate", "--model", str(checkpoint["packed"]), "--dtype", "float8", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--dtype 'float8': choose from float32, bfloat16, float16" in err


def test_quantized_experts_computed_in_bfloat16_are_lossless(expert_dtype_packs):
    packed = expert_dtype_packs["int4"][0]
    with OffloadEngine(make_plan(packed, fast_budget="100%", preload=True, dtype="bfloat16", device="cpu")) as engine:
        expected = {prompt: (result.token_ids, result.logits) for prompt in PROMPTS
                    for result in [engine.generate(prompt, max_new_tokens=NEW_TOKENS, return_logits=True)]}
        assert next(engine.model.parameters()).dtype == torch.bfloat16
    with OffloadEngine(make_plan(packed, fast_budget=f"{2 * read_manifest(packed).expert_bytes}B", dtype="bfloat16",
                                 prefetch="topk", device="cpu")) as engine:
        assert_lossless(engine, Checkpoint(expected=expected))
