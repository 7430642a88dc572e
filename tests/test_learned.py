"""FlashMoE's learned eviction (paper 003): model file, policy decisions, NumPy vs PyTorch, training."""

from __future__ import annotations

import builtins
import json
import re
import zipfile

import numpy as np
import pytest

from moe_offload import bundled
from moe_offload.errors import ConfigError
from moe_offload.policies import POLICIES, AccessContext, ModelSpec
from moe_offload.policies.learned import LearnedEviction
from moe_offload.policies.learned_model import (FORMAT_VERSION, LearnedModel, features, load_model, save_model,
                                                weights_digest)
from moe_offload.policies.lru import LRU
from moe_offload.simulator.cache import ExpertCache
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.format import Trace, TraceMeta, write_trace


def random_layers(widths=(2, 8, 8, 1), seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(o, i)).astype(np.float32), rng.normal(size=o).astype(np.float32))
            for i, o in zip(widths[:-1], widths[1:])]


def synthetic_trace(tokens=120, layers=4, experts=16, top_k=2, seed=0) -> Trace:
    """Skewed routing whose popular experts drift: something for recency and frequency to learn from."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(experts, 0.3), size=layers)
    out = np.empty((tokens, layers, top_k), dtype=np.int64)
    for n in range(tokens):
        if n % 40 == 39:
            weights = 0.5 * weights + 0.5 * rng.dirichlet(np.full(experts, 0.3), size=layers)
        for layer in range(layers):
            out[n, layer] = rng.choice(experts, size=top_k, replace=False, p=weights[layer])
    meta = TraceMeta(model="synthetic", num_layers=layers, num_experts=experts, top_k=top_k)
    return Trace.build(meta, experts=out)


def drive(policy, keys_per_token, cache_size, spec):
    """Serve [[key, ...] per token] in order; returns the evicted keys in order."""
    cache = ExpertCache(cache_size, policy)
    evicted = []
    original = cache.evict

    def evict(key):
        evicted.append(key)
        original(key)

    cache.evict = evict
    ctx = AccessContext()
    clock = 0
    for token, keys in enumerate(keys_per_token):
        ctx.token = token
        for key in keys:
            ctx.clock, ctx.layer = clock, spec.layer_of(key)
            cache.request(key, ctx)
            clock += 1
    return evicted


# ------------------------------------------------------------------------------------------- model file

def test_round_trip(tmp_path):
    layers = random_layers()
    path = save_model(tmp_path / "m.npz", layers, target={"horizon_requests": 8}, training={"seed": 3})
    model = load_model(path)
    assert model.widths == [2, 8, 8, 1]
    for (w, b), (w2, b2) in zip(layers, model.layers):
        np.testing.assert_array_equal(w, w2)
        np.testing.assert_array_equal(b, b2)
    assert model.metadata["format_version"] == FORMAT_VERSION
    assert model.metadata["training"] == {"seed": 3}
    assert model.metadata["weights_sha256"] == weights_digest(layers)
    x = np.random.default_rng(1).random((5, 2)).astype(np.float32)
    np.testing.assert_allclose(model.forward(x), LearnedModel(layers).forward(x))
    with np.load(path, allow_pickle=False) as npz:  # no pickled objects anywhere in the file
        assert sorted(npz.files) == ["b1", "b2", "b3", "metadata", "w1", "w2", "w3"]


def rewrite(path, out, *, meta_change=None, arrays_change=None):
    with np.load(path, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    meta = json.loads(str(arrays["metadata"]))
    if meta_change:
        meta_change(meta)
    arrays["metadata"] = np.array(json.dumps(meta))
    if arrays_change:
        arrays_change(arrays)
    with open(out, "wb") as fh:
        np.savez(fh, **arrays)
    return out


def _bad_files(tmp_path):
    good = save_model(tmp_path / "good.npz", random_layers())
    data = good.read_bytes()
    (tmp_path / "truncated.npz").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.npz").write_text("not a model\n")
    yield "missing", tmp_path / "nowhere.npz", "no such file"
    yield "truncated", tmp_path / "truncated.npz", "not a readable"
    yield "not npz", tmp_path / "text.npz", "not a readable"
    yield "newer", rewrite(good, tmp_path / "newer.npz",
                           meta_change=lambda m: m.update(format_version=FORMAT_VERSION + 1)), "newer"
    yield "bad version", rewrite(good, tmp_path / "v0.npz", meta_change=lambda m: m.update(format_version="1")), \
        "format_version"
    yield "other format", rewrite(good, tmp_path / "fmt.npz", meta_change=lambda m: m.update(format="x")), "format"
    yield "features", rewrite(good, tmp_path / "feat.npz",
                              meta_change=lambda m: m["features"].update(names=["recency"])), "features"

    def tamper(arrays):
        arrays["w2"] = arrays["w2"] + np.float32(1e-3)

    yield "checksum", rewrite(good, tmp_path / "tampered.npz", arrays_change=tamper), "checksum"

    def reshape(arrays):
        arrays["w2"] = np.zeros((8, 7), np.float32)

    yield "shape", rewrite(good, tmp_path / "shape.npz", arrays_change=reshape), "shape"

    def drop(arrays):
        del arrays["b3"]

    yield "missing array", rewrite(good, tmp_path / "drop.npz", arrays_change=drop), "missing b3"

    def widen(meta):
        meta["architecture"]["layers"] = [2, 8, 9, 1]

    yield "architecture", rewrite(good, tmp_path / "arch.npz", meta_change=widen), "shape"

    with open(tmp_path / "pickle.npz", "wb") as fh:
        arrays = {"metadata": np.array("{}"), "w1": np.array([1, "a"], dtype=object)}
        np.savez(fh, **arrays)
    yield "pickle", tmp_path / "pickle.npz", "not a readable"
    with zipfile.ZipFile(tmp_path / "empty.npz", "w"):
        pass
    yield "no metadata", tmp_path / "empty.npz", "metadata"
    (tmp_path / "dir.npz").mkdir()
    yield "directory", tmp_path / "dir.npz", "directory"


def test_bad_model_files_raise_config_error_naming_the_file(tmp_path):
    cases = list(_bad_files(tmp_path))
    assert len(cases) >= 10
    for name, path, problem in cases:
        with pytest.raises(ConfigError) as info:
            load_model(path)
        message = str(info.value)
        assert str(path) in message, name
        assert problem in message, (name, message)


def test_policy_reports_bad_model_path(tmp_path):
    data = ReplayInput.of(synthetic_trace(tokens=10))
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "absent.npz"))):
        replay(data, "learned", 8, options={"model_path": str(tmp_path / "absent.npz")})


# ------------------------------------------------------------------------------------------- decisions

def monotone_in_recency(tmp_path):
    """score = -silu(silu(1/r)): the higher r (the longer unused), the higher the score."""
    layers = [(np.array([[1.0, 0.0]], np.float32), np.zeros(1, np.float32)),
              (np.array([[1.0]], np.float32), np.zeros(1, np.float32)),
              (np.array([[-1.0]], np.float32), np.zeros(1, np.float32))]
    return save_model(tmp_path / "recency.npz", layers)


def monotone_in_inverse_frequency(tmp_path):
    """score = -f / max f: the rarer, the higher the score."""
    return save_model(tmp_path / "freq.npz", [(np.array([[0.0, -1.0]], np.float32), np.zeros(1, np.float32))])


# A dozen requests; L = 2 layers of J = 4 experts, K = 1: keys 0-3 are layer 0, 4-7 layer 1.
SEQUENCE = [[0, 4], [1, 5], [0, 6], [2, 4], [3, 7], [0, 5]]


def test_recency_network_evicts_like_lru(tmp_path):
    spec = ModelSpec(2, 4, 1)
    learned = drive(LearnedEviction(spec, model_path=monotone_in_recency(tmp_path)), SEQUENCE, 4, spec)
    lru = drive(LRU(spec), SEQUENCE, 4, spec)
    assert learned == lru == [4, 1, 5, 0, 6, 2, 4]


def test_inverse_frequency_network_evicts_the_rarest(tmp_path):
    spec = ModelSpec(2, 4, 1)
    evicted = drive(LearnedEviction(spec, model_path=monotone_in_inverse_frequency(tmp_path)), SEQUENCE, 4, spec)
    # By hand: f counts tokens routed (kept across evictions); ties go to the older last request.
    # t2 key 6: {0:2, 4:1, 1:1, 5:1} -> 4 (f=1, oldest); t3 key 2: {0,1,5,6} f 2,1,1,1 -> 1;
    # t3 key 4: {0,5,6,2} f 2,1,1,1 -> 5; t4 key 3: {0,6,2,4} f 2,1,1,2 -> 6;
    # t4 key 7: {0,2,4,3} f 2,1,2,1 -> 2; t5 key 5: {0,4,3,7} f 3,2,1,1 -> 3.
    assert evicted == [4, 1, 5, 6, 2, 3]


class CheckedLearned(LearnedEviction):
    """LearnedEviction that recomputes every decision from scratch: all residents' features, one
    forward pass, highest score, ties to the older last request."""

    def __init__(self, spec, **kwargs):
        super().__init__(spec, **kwargs)
        self.ref_last, self.ref_freq, self.ref_clock, self.ref_resident = {}, {}, {}, set()
        self.decisions = 0

    def on_access(self, key, ctx):
        super().on_access(key, ctx)
        if self.ref_last.get(key) != ctx.token:
            self.ref_last[key] = ctx.token
            self.ref_freq[key] = self.ref_freq.get(key, 0) + 1
        self.ref_clock[key] = ctx.clock

    def on_insert(self, key, ctx):
        super().on_insert(key, ctx)
        self.ref_resident.add(key)

    def on_evict(self, key):
        super().on_evict(key)
        self.ref_resident.discard(key)

    def victim(self, ctx):
        chosen = super().victim(ctx)
        keys = sorted(k for k in self.ref_resident if k not in ctx.pinned)
        r = np.array([ctx.token - self.ref_last[k] + 1 for k in keys])
        f = np.array([self.ref_freq[k] for k in keys])
        scores = self.model.forward(features(r, f, max(self.ref_freq.values())))
        top = scores.max()
        best = min((k for k, s in zip(keys, scores) if s == top), key=self.ref_clock.get)
        if chosen != best:  # only a rounding difference between batched and single evaluations may differ
            assert abs(scores[keys.index(chosen)] - top) <= 1e-6 * max(1.0, abs(top))
        assert chosen not in ctx.pinned
        self.decisions += 1
        return chosen


@pytest.mark.parametrize("cache_size", [4, 10, 40])
def test_evicts_the_highest_scored_resident(tmp_path, cache_size):
    path = save_model(tmp_path / "random.npz", random_layers(seed=cache_size))
    trace = synthetic_trace(tokens=60, seed=cache_size)
    data = ReplayInput.of(trace)
    spec = data.spec
    policy = CheckedLearned(spec, model_path=path)
    cache = ExpertCache(cache_size, policy)
    ctx = AccessContext()
    seq = data.sequence
    for t, (key, token) in enumerate(zip(seq.expert_id.tolist(), seq.token.tolist())):
        ctx.clock, ctx.token, ctx.layer = t, token, t % spec.num_layers
        # pin the other experts of the same layer and token, as the timed simulator does
        layer = t % spec.num_layers
        ctx.pinned = {layer * spec.num_experts + int(e) for e in trace.experts[token, layer]} - {key}
        cache.request(key, ctx)
    assert policy.decisions > 20
    # the fast policy inside replay() makes the same decisions as the checked one
    fast = replay(data, "learned", cache_size, options={"model_path": str(path)})
    checked = replay_with(CheckedLearned(spec, model_path=path), data, cache_size)
    assert fast.misses == checked


def replay_with(policy, data, cache_size):
    cache = ExpertCache(cache_size, policy)
    ctx = AccessContext()
    misses = 0
    seq = data.sequence
    for t, (key, token) in enumerate(zip(seq.expert_id.tolist(), seq.token.tolist())):
        ctx.clock, ctx.token, ctx.layer = t, token, t % data.spec.num_layers
        misses += not cache.request(key, ctx)
    return misses


def test_victim_skips_pinned_experts(tmp_path):
    data = ReplayInput.of(synthetic_trace(tokens=5, layers=2, experts=8, top_k=4))
    from moe_offload.policies.base import NoEvictableExpert
    spec = data.spec
    policy = LearnedEviction(spec, model_path=save_model(tmp_path / "m.npz", random_layers()))
    ctx = AccessContext()
    for key in range(4):
        policy.on_access(key, ctx)
        policy.on_insert(key, ctx)
    ctx.pinned = {0, 1, 2, 3}
    with pytest.raises(NoEvictableExpert):
        policy.victim(ctx)
    ctx.pinned = {0, 1, 3}
    assert policy.victim(ctx) == 2


def test_prefetched_expert_never_routed_has_zero_features(tmp_path):
    spec = ModelSpec(1, 8, 1)
    policy = LearnedEviction(spec, model_path=monotone_in_recency(tmp_path))  # evicts the largest r
    ctx = AccessContext()
    for token, key in enumerate([0, 1]):
        ctx.token = ctx.clock = token
        policy.on_access(key, ctx)
        policy.on_insert(key, ctx)
    ctx.prefetch = True
    policy.on_insert(5, ctx)  # 1/r = 0: the "oldest" of all
    ctx.prefetch = False
    assert policy.victim(ctx) == 5
    assert set(policy.scores(ctx)) == {0, 1, 5}


# ------------------------------------------------------------------------------------------ NumPy vs torch

def test_numpy_forward_matches_torch():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 128), torch.nn.SiLU(), torch.nn.Linear(128, 128), torch.nn.SiLU(),
                              torch.nn.Linear(128, 1))
    layers = [(m.weight.detach().numpy(), m.bias.detach().numpy()) for m in net if isinstance(m, torch.nn.Linear)]
    model = LearnedModel(layers)
    x = np.random.default_rng(0).uniform(-3, 3, size=(1000, 2)).astype(np.float32)
    with torch.no_grad():
        expected = net(torch.from_numpy(x))[:, 0].numpy()
    np.testing.assert_allclose(model.forward(x), expected, rtol=1e-5, atol=1e-5)


def test_features_follow_the_paper():
    x = features(np.array([1, 2, 4, 0]), np.array([3, 6, 0, 0]), 6)
    np.testing.assert_allclose(x, [[1.0, 0.5], [0.5, 1.0], [0.25, 0.0], [0.0, 0.0]])
    assert x.dtype == np.float32
    np.testing.assert_array_equal(features(np.array([1]), np.array([0]), 0), [[1.0, 0.0]])


# ----------------------------------------------------------------------------------------------- training

def test_short_training_produces_a_loadable_model(tmp_path):
    pytest.importorskip("torch")
    from moe_offload.training import collect_belady_samples, train_learned_eviction

    trace = synthetic_trace(tokens=80)
    samples = collect_belady_samples(trace.select(slice(0, 60)), [8])
    assert len(samples) and samples.chosen.sum() == samples.moments  # one Belady victim per moment
    # every sample is a resident at a Belady eviction: 8 residents per moment, routed at least once
    assert len(samples) == 8 * samples.moments and (samples.freq >= 1).all() and (samples.recency >= 1).all()
    result = train_learned_eviction(trace, rows=(0, 60), cache_sizes=[8, 16], epochs=3, seed=1)
    path = result.save(tmp_path / "trained.npz")
    model = load_model(path)
    assert model.widths == [2, 128, 128, 1]
    training = model.metadata["training"]
    assert training["rows"] == "0:60" and training["cache_sizes"] == [8, 16] and training["seed"] == 1
    assert training["epochs_run"] <= 3 and np.isfinite(training["validation_loss"])
    assert "torch_version" in training and model.metadata["target"]["horizon_requests"] > 0
    held_out = ReplayInput.of(trace.select(slice(60, 80)))
    result = replay(held_out, "learned", 8, options={"model_path": str(path)})
    assert 0 < result.misses <= result.accesses


def test_train_eviction_command(tmp_path, capsys):
    pytest.importorskip("torch")
    from moe_offload.cli.main import main

    trace_path = write_trace(synthetic_trace(tokens=80), tmp_path / "synthetic.parquet")
    out = tmp_path / "model.npz"
    code = main(["train-eviction", str(trace_path), "--rows", "0:60", "--cache-sizes", "8", "16", "--epochs", "2",
                 "--seed", "0", "-o", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "validation MSE" in printed and "misses on rows 60:80 (held out)" in printed
    assert re.search(r"^\s+8\s+\d+\s+\d+\s+\d+\s+\d+", printed, re.M)
    load_model(out)
    assert main(["train-eviction", str(trace_path), "--rows", "70:60", "-o", str(out)]) == 2
    assert "--rows" in capsys.readouterr().err


def test_train_eviction_without_torch(tmp_path, monkeypatch, capsys):
    from moe_offload.cli.main import main

    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("No module named 'torch'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    assert main(["train-eviction", str(tmp_path / "t.parquet"), "-o", str(tmp_path / "m.npz")]) == 2
    assert "pip install torch" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- shipped

def test_shipped_model():
    assert POLICIES["learned"].policy is LearnedEviction
    path = bundled.DEFAULT_LEARNED_MODEL
    assert path.stat().st_size < 300_000
    model = load_model(path)
    assert model.widths == [2, 128, 128, 1]
    training = model.metadata["training"]
    assert training["rows"] == "0:150" and training["cache_sizes"] == [64, 128, 256, 512]
    assert "olmoe" in training["trace"].lower()
    spec = ModelSpec(16, 64, 8)
    assert LearnedEviction(spec).model.metadata["weights_sha256"] == model.metadata["weights_sha256"]
