"""FlashMoE's learned eviction (paper 003): model file, policy decisions, NumPy vs PyTorch, training."""

from __future__ import annotations

import builtins
import hashlib
import json
import re
import zipfile

import numpy as np
import pytest

from moe_offload import bundled
from moe_offload.errors import ConfigError
from moe_offload.policies import POLICIES, AccessContext, ModelSpec
from moe_offload.policies.learned import LearnedEviction
from moe_offload.policies.learned_model import (FORMAT_VERSION, GRID_COLUMNS, GRID_ROWS, TARGETS, LearnedModel,
                                                column_scale, features, grid_column, grid_columns, grid_features,
                                                grid_row, grid_rows, load_model, save_model, weights_digest)
from moe_offload.policies.lru import LRU
from moe_offload.simulator.cache import ExpertCache
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.format import Trace, TraceMeta, read_trace, write_trace


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
    path = save_model(tmp_path / "m.npz", layers, target={"kind": "log-distance"}, training={"seed": 3})
    model = load_model(path)
    assert model.widths == [2, 8, 8, 1]
    for (w, b), (w2, b2) in zip(layers, model.layers):
        np.testing.assert_array_equal(w, w2[0])
        np.testing.assert_array_equal(b, b2[0])
    assert model.metadata["format_version"] == FORMAT_VERSION == 2
    assert model.metadata["training"] == {"seed": 3}
    assert model.metadata["target"] == {"kind": "log-distance", "definition": TARGETS["log-distance"]}
    assert model.metadata["weights_sha256"] == weights_digest(model.layers)
    with pytest.raises(ConfigError, match="unknown learned-eviction target 'capped'"):
        save_model(tmp_path / "bad.npz", layers, target={"kind": "capped"})
    x = np.random.default_rng(1).random((5, 2)).astype(np.float32)
    np.testing.assert_allclose(model.forward(x), LearnedModel(layers).forward(x))
    with np.load(path, allow_pickle=False) as npz:  # no pickled objects anywhere in the file
        assert sorted(npz.files) == ["b1", "b2", "b3", "metadata", "w1", "w2", "w3"]
        assert npz["w2"].shape == (1, 8, 8)  # [networks, out, in]
    assert model.networks == 1 and not model.per_layer


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
    # version 1: one network trained on a next-use distance capped at two tokens (issue 9, deviation 4)
    yield "version 1", rewrite(good, tmp_path / "v1.npz", meta_change=lambda m: m.update(format_version=1)), \
        "retrain it with `moe-offload train-eviction`"

    def several_shared(meta):
        meta["architecture"]["networks"] = 2

    yield "networks", rewrite(good, tmp_path / "networks.npz", meta_change=several_shared), "per_layer"
    yield "other format", rewrite(good, tmp_path / "fmt.npz", meta_change=lambda m: m.update(format="x")), "format"
    yield "features", rewrite(good, tmp_path / "feat.npz",
                              meta_change=lambda m: m["features"].update(names=["recency"])), "features"

    def tamper(arrays):
        arrays["w2"] = arrays["w2"] + np.float32(1e-3)

    yield "checksum", rewrite(good, tmp_path / "tampered.npz", arrays_change=tamper), "checksum"

    def reshape(arrays):
        arrays["w2"] = np.zeros((1, 8, 7), np.float32)

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
    """LearnedEviction that recomputes every decision from scratch: all residents' grid points, one
    forward pass of the network on their inputs, highest score, ties to the older last request."""

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
        scale = column_scale(max(self.ref_freq.values()))
        points = [grid_row(ctx.token - self.ref_last[k] + 1) * GRID_COLUMNS + grid_column(self.ref_freq[k], scale)
                  for k in keys]
        scores = self.model.forward(grid_features()[points])
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


def test_per_layer_model_scores_each_expert_with_its_layers_network(tmp_path):
    # Paper 003 trains "the lightweight per-layer ML cache FFN": network l scores the experts of MoE layer l.
    # Network 0 scores -1/r (evicts layer 0's least recent), network 1 scores +1/r (layer 1's most recent),
    # and network 1's scores sit above network 0's (bias 5): every victim is layer 1's most recent expert.
    older_first = (np.array([[[-1.0, 0.0]]], np.float32), np.zeros((1, 1), np.float32))
    newer_first = (np.array([[[1.0, 0.0]]], np.float32), np.full((1, 1), 5.0, np.float32))
    layers = [(np.concatenate([older_first[0], newer_first[0]]), np.concatenate([older_first[1], newer_first[1]]))]
    path = save_model(tmp_path / "per-layer.npz", layers, per_layer=True)
    model = load_model(path)
    assert model.networks == 2 and model.per_layer
    spec = ModelSpec(2, 4, 1)
    policy = LearnedEviction(spec, model_path=path)
    ctx = AccessContext()
    for token, key in enumerate([0, 4, 1, 5, 2]):  # layer 0: 0, 1, 2; layer 1: 4, 5
        ctx.token = ctx.clock = token
        policy.on_access(key, ctx)
        policy.on_insert(key, ctx)
    scores = policy.scores(ctx)
    # token 4: r = 5, 4, 3, 2, 1 for keys 0, 4, 1, 5, 2
    assert scores == pytest.approx({0: -1 / 5, 1: -1 / 3, 2: -1.0, 4: 5 + 1 / 4, 5: 5 + 1 / 2})
    assert policy.victim(ctx) == 5
    ctx.pinned = {4, 5}
    assert policy.victim(ctx) == 0
    with pytest.raises(ConfigError, match="2 per-layer networks do not fit a model of 3 MoE layers"):
        LearnedEviction(ModelSpec(3, 4, 1), model_path=path)


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


def test_forward_scores_do_not_depend_on_blas_threads():
    # OpenBLAS splits a product of 64 rows or more over its threads, which moves float32 scores in their last
    # bits: the forward pass runs on one thread whatever the process set, and leaves that setting as it was
    from threadpoolctl import ThreadpoolController

    blas = ThreadpoolController().select(user_api="blas")
    model = load_model(bundled.DEFAULT_LEARNED_MODEL)
    x = np.random.default_rng(0).uniform(0, 1, size=(1000, 2)).astype(np.float32)
    scores = {}
    for threads in (1, 2):
        with blas.limit(limits=threads):
            scores[threads] = model.forward(x)
            assert {info["num_threads"] for info in blas.info()} == {threads}
    assert np.array_equal(scores[1], scores[2])


def test_features_follow_the_paper():
    x = features(np.array([1, 2, 4, 0]), np.array([3, 6, 0, 0]), 6)
    np.testing.assert_allclose(x, [[1.0, 0.5], [0.5, 1.0], [0.25, 0.0], [0.0, 0.0]])
    assert x.dtype == np.float32
    np.testing.assert_array_equal(features(np.array([1]), np.array([0]), 0), [[1.0, 0.0]])


def test_the_grid_reads_recency_exactly_up_to_128_tokens_and_frequency_to_a_1024th():
    # rows: 0 never routed, r itself up to 128, then 128 bins of equal width in 1/r, row 129 + 16384 // r
    recency = [0, 1, 128, 129, 130, 256, 16384, 16385, 10**9]
    assert [grid_row(r) for r in recency] == [0, 1, 128, 256, 255, 193, 130, 129, 129]
    # columns: f / max f to the nearest 1/1024, halves up; max f = 0 (nothing routed yet) is column 0
    assert [grid_column(f, column_scale(3)) for f in range(4)] == [0, 341, 683, 1024]
    assert [grid_column(f, column_scale(2048)) for f in (1, 3, 2048)] == [1, 2, 1024]
    assert grid_column(0, column_scale(0)) == 0
    # the policy's NumPy forms give the same rows and columns
    r = np.arange(40_000)
    np.testing.assert_array_equal(grid_rows(r), [grid_row(int(x)) for x in r])
    for max_freq in (1, 3, 7, 1000, 4097):
        f = np.arange(max_freq + 1)
        np.testing.assert_array_equal(grid_columns(f, max_freq),
                                      [grid_column(int(x), column_scale(max_freq)) for x in f])
    # the network's inputs there: the paper's 1/r up to 128, a bin's middle in 1/r beyond, the column's q
    x = grid_features().reshape(GRID_ROWS, GRID_COLUMNS, 2)
    np.testing.assert_array_equal(x[1:129, 0, 0], features(np.arange(1, 129), np.zeros(128), 0)[:, 0])
    assert x[0, 0, 0] == 0 and x[129, 0, 0] == np.float32(0.5 / 16384) and x[256, 0, 0] == np.float32(127.5 / 16384)
    np.testing.assert_array_equal(x[5, :, 1], (np.arange(1025) / 1024).astype(np.float32))


def test_the_score_table_is_the_network_at_every_grid_point():
    # a linear network, 2 / r - 3 q + 1 on the grid's inputs, and a second one (per layer) of the opposite sign
    weight = np.array([[[2.0, -3.0]], [[-2.0, 3.0]]], np.float32)
    bias = np.array([[1.0], [-1.0]], np.float32)
    table = LearnedModel([(weight, bias)], metadata={"architecture": {"per_layer": True}}).score_table()
    x = grid_features().reshape(GRID_ROWS, GRID_COLUMNS, 2).astype(np.float64)
    expected = 2 * x[..., 0] - 3 * x[..., 1] + 1
    assert table.shape == (2, GRID_ROWS, GRID_COLUMNS) and table.dtype == np.float64
    np.testing.assert_allclose(table[0], expected, atol=1e-6)
    np.testing.assert_allclose(table[1], -expected, atol=1e-6)
    assert not table.flags.writeable  # shared by every policy built from these weights


@pytest.mark.parametrize("per_layer", [False, True])
def test_the_kernel_makes_the_python_policys_decisions(tmp_path, per_layer):
    # random networks rank by both inputs in no simple order; a per-layer model reads each layer's own table
    layers = random_layers(seed=3)
    if per_layer:
        layers = [(np.stack([w, -w, 0.5 * w, w[::-1]]), np.stack([b, b, -b, b])) for w, b in layers]
    path = save_model(tmp_path / "m.npz", layers, per_layer=per_layer)
    data = ReplayInput.of(synthetic_trace(tokens=400, seed=5))
    for size in (3, 8, 20, 50):
        options = {"model_path": str(path)}
        python = replay(data, "learned", size, options=options, engine="python")
        assert replay(data, "learned", size, options=options).to_dict() == python.to_dict()


# ----------------------------------------------------------------------------------------------- training

def samples_of(moments):
    """BeladySamples from [(distances, remaining), ...], one eviction moment each (L*K = 8 requests a token)."""
    from moe_offload.training.learned_eviction import BeladySamples

    distance = np.concatenate([np.asarray(d, dtype=np.int64) for d, _ in moments])
    n = distance.size
    moment = np.concatenate([np.full(len(d), i, dtype=np.int64) for i, (d, _) in enumerate(moments)])
    remaining = np.concatenate([np.full(len(d), r, dtype=np.int64) for d, r in moments])
    ones = np.ones(n, dtype=np.int64)
    return BeladySamples(recency=ones, freq=ones, max_freq=ones, distance=distance, remaining=remaining,
                         layer=0 * ones, moment=moment, token=0 * ones, clock=0 * ones, chosen=np.zeros(n, bool),
                         cache_size=ones, source=0 * ones, per_token=8 * ones)


def test_targets_keep_the_order_of_next_uses():
    # Paper 003 predicts each cached expert's "routing distance" and evicts the highest; the targets must
    # order the residents as their next uses do, at any distance. -1: not requested again in the rows.
    samples = samples_of([([5, -1, 2, 5, 40], 100), ([3, 7], 50)])
    # rank: positions by distance 2 -> 0, 5 and 5 -> 1.5 (tied), 40 -> 3, never -> 4; over 4
    np.testing.assert_allclose(samples.targets("rank"), [0.375, 1.0, 0.0, 0.375, 0.75, 0.0, 1.0])
    # log-distance: ln(d / 8); never requested again: d = the requests left + 1, a lower bound
    np.testing.assert_allclose(samples.targets("log-distance"),
                               np.log(np.array([5, 101, 2, 5, 40, 3, 7]) / 8))
    with pytest.raises(ConfigError, match="unknown target"):
        samples.targets("capped")


def test_targets_do_not_saturate_at_large_caches():
    # Issue 9: the version-1 target min(d, 2 tokens) was 1 for 49% and 66% of Belady's residents at 256 and 512
    # cached experts of the bundled trace, so the network could not tell Belady's victim apart. The targets now
    # are strictly monotone in the next use within every eviction moment, and the furthest gets the maximum.
    # Paper 003: "Assuming Belady's optimal cache replacement algorithm, masked target data indicating which
    # experts should be evicted at each time step were generated": the samples are Belady's own cache states
    # (the default), each moment's victim the one Belady evicts.
    from moe_offload.training.learned_eviction import TrainingSource, collect_belady_samples

    trace = read_trace(bundled.DEFAULT_TRACE)
    samples = collect_belady_samples(TrainingSource(trace, (0, 150), [256, 512]))
    horizon = 2 * 16 * 8
    kept = samples.select(samples.clock <= 150 * 128 - horizon)
    for size, share in ((256, 0.49), (512, 0.66)):
        capped = ((kept.distance < 0) | (kept.distance >= horizon))[kept.cache_size == size].mean()
        assert capped == pytest.approx(share, abs=0.01)
    far = np.where(kept.distance < 0, np.iinfo(np.int64).max, kept.distance)
    for kind in ("rank", "log-distance"):
        y = kept.targets(kind)
        order = np.lexsort((far, kept.moment))
        same_moment = kept.moment[order][1:] == kept.moment[order][:-1]
        farther = far[order][1:] > far[order][:-1]
        assert (np.diff(y[order])[same_moment & farther] > 0).all(), kind
        assert (np.diff(y[order])[same_moment & ~farther] == 0).all(), kind
        victims = kept.select(kept.chosen)  # Belady's victims have their moment's largest target
        best = np.full(kept.moment.max() + 1, -np.inf)
        np.maximum.at(best, kept.moment, y)
        assert np.array_equal(y[kept.chosen], best[victims.moment]), kind


def source(trace, rows, sizes):
    from moe_offload.training.learned_eviction import TrainingSource

    return TrainingSource(trace=trace, rows=rows, cache_sizes=sizes)


def test_training_across_traces_and_cache_sizes(tmp_path):
    pytest.importorskip("torch")
    from moe_offload.training import collect_belady_samples, train_learned_eviction

    first = synthetic_trace(tokens=80)
    second = synthetic_trace(tokens=70, layers=2, experts=8, top_k=1, seed=3)
    samples = collect_belady_samples(source(first, (0, 60), [8]), behaviour="belady")
    assert len(samples) and samples.chosen.sum() == samples.moments  # one Belady victim per moment
    # every sample is a resident at a Belady eviction: 8 residents per moment, routed at least once
    assert len(samples) == 8 * samples.moments and (samples.freq >= 1).all() and (samples.recency >= 1).all()
    lru = collect_belady_samples(source(first, (0, 60), [8]), behaviour="lru")  # LRU's cache states
    oldest = np.zeros(lru.moment.max() + 1, dtype=np.int64)
    np.maximum.at(oldest, lru.moment, lru.recency)
    assert lru.chosen.sum() == lru.moments and (lru.recency[lru.chosen] == oldest[lru.moment[lru.chosen]]).all()
    result = train_learned_eviction([source(first, (0, 60), [8, 16]), source(second, (10, 70), [4, 6])],
                                    target="log-distance", states=("lru", "belady"), epochs=3, seed=1)
    path = result.save(tmp_path / "trained.npz")
    model = load_model(path)
    assert model.widths == [2, 128, 128, 1] and model.networks == 1
    training = model.metadata["training"]
    assert [(t["rows"], t["cache_sizes"], t["shape"]["num_layers"]) for t in training["traces"]] == \
        [("0:60", [8, 16], 4), ("10:70", [4, 6], 2)]
    assert training["states"] == ["lru", "belady"] and training["seed"] == 1
    assert max(training["epochs_run"]) <= 3 and np.isfinite(training["validation_loss"])
    assert "torch_version" in training and model.metadata["target"]["kind"] == "log-distance"
    held_out = ReplayInput.of(first.select(slice(60, 80)))
    result = replay(held_out, "learned", 8, options={"model_path": str(path)})
    assert 0 < result.misses <= result.accesses
    with pytest.raises(ConfigError, match="same number of MoE layers"):
        train_learned_eviction([source(first, (0, 60), [8]), source(second, (0, 60), [4])], per_layer=True)
    with pytest.raises(ConfigError, match="cache size 64 must be at least top-k = 2 and below its 64 experts"):
        train_learned_eviction([source(first, (0, 60), [64])])


def test_per_layer_training(tmp_path):
    pytest.importorskip("torch")
    from moe_offload.training import train_learned_eviction

    trace = synthetic_trace(tokens=80)
    result = train_learned_eviction([source(trace, (0, 60), [8, 16])], per_layer=True, epochs=2, seed=0)
    model = load_model(result.save(tmp_path / "per-layer.npz"))
    assert model.networks == 4 and model.per_layer and model.widths == [2, 128, 128, 1]
    assert len(model.metadata["training"]["epochs_run"]) == 4
    # the four networks were trained on different samples: they differ
    assert not np.array_equal(model.layers[0][0][0], model.layers[0][0][1])
    result = replay(ReplayInput.of(trace.select(slice(60, 80))), "learned", 8, options={"model_path": str(
        tmp_path / "per-layer.npz")})
    assert 0 < result.misses <= result.accesses


def test_train_eviction_command(tmp_path, capsys):
    pytest.importorskip("torch")
    from moe_offload.cli.main import main

    trace_path = write_trace(synthetic_trace(tokens=80), tmp_path / "synthetic.parquet")
    other = write_trace(synthetic_trace(tokens=60, seed=5), tmp_path / "other.parquet")
    out = tmp_path / "model.npz"
    code = main(["train-eviction", f"{trace_path}@0:60", f"{other}@:40", "--cache-sizes", "8,25%", "--epochs", "2",
                 "--seed", "0", "-o", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "validation MSE" in printed and "misses on held-out rows" in printed
    # the rows of each training trace not trained on, at 8 and 25% of 64 = 16 experts
    for name, rows in (("synthetic.parquet", "60:80"), ("other.parquet", "40:60")):
        for size in (8, 16):
            assert re.search(rf"^{name}\s+{rows}\s+{size}\s+\d+\s+\d+\s+\d+\s+\d\.\d{{3}}", printed, re.M)
    held_out = load_model(out).metadata["training"]["held_out"]
    assert {(h["trace"], h["rows"], h["cache_size"]) for h in held_out} == {
        ("synthetic.parquet", "60:80", 8), ("synthetic.parquet", "60:80", 16), ("other.parquet", "40:60", 8),
        ("other.parquet", "40:60", 16)}
    assert all(h["rows_trained_on"] == 0 and h["learned_misses"] > 0 for h in held_out)
    # evaluating on rows trained on is said so
    assert main(["train-eviction", f"{trace_path}@0:60", "--eval", f"{trace_path}@50:80", "--cache-sizes", "8",
                 "--epochs", "1", "-o", str(out)]) == 0
    assert "50:80*" in capsys.readouterr().out
    for bad, problem in (([f"{trace_path}@70:60"], "rows '70:60'"), ([f"{trace_path}@0:60", "--states", "nope"],
                                                                    "unknown policy"),
                         ([f"{trace_path}@0:60", "--cache-sizes", "64"], "below its 64 experts")):
        assert main(["train-eviction", *bad, "-o", str(out)]) == 2
        assert problem in capsys.readouterr().err


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
    # The shipped model is the command of src/moe_offload/data/NOTICE.md: one network on the log distance,
    # trained on Belady's states of OLMoE rows 0:150 at four cache sizes.
    assert POLICIES["learned"].policy is LearnedEviction
    path = bundled.DEFAULT_LEARNED_MODEL
    assert path.stat().st_size < 300_000
    model = load_model(path)
    assert model.widths == [2, 128, 128, 1] and model.networks == 1
    assert model.metadata["target"]["kind"] == "log-distance"
    training = model.metadata["training"]
    assert training["states"] == ["belady"]
    assert [(t["trace"], t["rows"], t["cache_sizes"]) for t in training["traces"]] == [
        ("olmoe-1b-7b-decode299.parquet", "0:150", [64, 128, 256, 512])]
    assert model.rows_trained_on(hashlib.sha256(bundled.DEFAULT_TRACE.read_bytes()).hexdigest()) == ["0:150"]
    spec = ModelSpec(16, 64, 8)
    assert LearnedEviction(spec).model.metadata["weights_sha256"] == model.metadata["weights_sha256"]
    # the held-out misses the training command recorded are what the policy makes on those rows
    held_out = {(h["trace"], h["rows"], h["cache_size"]): h for h in training["held_out"]}
    assert all(h["rows_trained_on"] == 0 for h in held_out.values())
    recorded = held_out[("olmoe-1b-7b-decode299.parquet", "150:299", 128)]
    rows = ReplayInput.of(read_trace(bundled.DEFAULT_TRACE).select(slice(150, 299)))
    assert replay(rows, "learned", 128).misses == recorded["learned_misses"]
    assert replay(rows, "lru", 128).misses == recorded["lru_misses"]
