"""MoEpic's split in the runtime (runtime/split.py): lossless against the all-resident model computing with the
same split, over budgets, cached tops and split ratios; memory and bytes moved worked out by hand; the bottom's
integrity check; one-line refusals of bad configurations."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from model_configs import build, tiny_tokenizer  # noqa: E402
from waits import RESULT_WAIT_S  # noqa: E402

from moe_offload.cli.main import main  # noqa: E402
from moe_offload.errors import ConfigError  # noqa: E402
from moe_offload.models.adapters import load_model  # noqa: E402
from moe_offload.models.experts import use_project_experts  # noqa: E402
from moe_offload.plan import make_plan  # noqa: E402
from moe_offload.runtime.engine import OffloadEngine  # noqa: E402
from moe_offload.runtime.packing import pack_model, read_manifest  # noqa: E402
from moe_offload.runtime.storage import ExpertReadError  # noqa: E402
from moe_offload.simulator.split import LayerSplitPlan, SplitConfig  # noqa: E402

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog."]
NEW_TOKENS = 6
LAYERS, EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 3, 6, 2, 32, 48  # tests/model_configs.py's mixtral
FLOAT32 = 4


def make_checkpoint(root):
    """The tiny random Mixtral saved in float16 with a tokenizer under ``root``/model, packed under ``root``/packed."""
    model, _ = build("mixtral", seed=3)
    model.half().save_pretrained(root / "model")
    tiny_tokenizer().save_pretrained(root / "model")
    pack_model(root / "model", root / "packed")
    return root


@pytest.fixture(scope="module")
def split_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("split"))


_REFERENCES: dict = {}


def reference(root, rows):
    """Tokens and logits of the all-resident float32 model, computing each expert in the split at ``rows``
    (None: unsplit), for every prompt."""
    key = (str(root), rows)
    if key not in _REFERENCES:
        if root not in _REFERENCES:  # the model and the tokenizer, loaded once
            _REFERENCES[root] = (*load_model(root / "model"), tiny_tokenizer())
        model, adapter, tokenizer = _REFERENCES[root]
        use_project_experts(adapter, None, list(rows) if rows is not None else None)
        out = {}
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                           max_new_tokens=NEW_TOKENS, return_dict_in_generate=True,
                                           output_logits=True, pad_token_id=0)
            out[prompt] = (generated.sequences[0, ids.shape[1]:].tolist(), [step[0] for step in generated.logits])
        _REFERENCES[key] = out
    return _REFERENCES[key]


def memory_bytes(cached, rows):
    """By hand: a top of r rows is r gate rows, r up rows and r down columns of HIDDEN values; the buffer holds
    TOP_K whole experts; float32 on a CPU."""
    tops = sum(c * 3 * r * HIDDEN for c, r in zip(cached, rows))
    return (tops + TOP_K * 3 * INTERMEDIATE * HIDDEN) * FLOAT32


def config(cached, ratios):
    return SplitConfig(tuple(LayerSplitPlan(c, theta) for c, theta in zip(cached, ratios)))


RATIOS = st.sampled_from([1 / INTERMEDIATE, 0.25, 0.5, 0.73, 1.0])


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cached=st.lists(st.integers(1, EXPERTS), min_size=LAYERS, max_size=LAYERS),
       ratios=st.lists(RATIOS, min_size=LAYERS, max_size=LAYERS), policy=st.sampled_from(["lru", "lfu", "fifo"]),
       slack=st.sampled_from([0, 1000]))
def test_the_split_runtime_is_lossless_over_budgets_and_split_ratios(split_checkpoint, cached, ratios, policy, slack):
    rows = tuple(round(theta * INTERMEDIATE) for theta in ratios)
    expected = reference(split_checkpoint, rows)
    need = memory_bytes(cached, rows)
    with OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget=f"{need + slack}B", policy=policy, device="cpu",
                                 split_config=config(cached, ratios))) as engine:
        assert engine.split.memory_bytes == need
        for prompt, (tokens, logits) in expected.items():
            result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, return_logits=True)
            assert result.token_ids == tokens
            assert all(torch.equal(a, b) for a, b in zip(result.logits, logits))
            stats = result.stats
            assert stats.cache_bytes == need and stats.cache_size == sum(cached)
            assert stats.hits + stats.misses == stats.accesses > 0


def test_bottoms_alone_move_their_share_of_an_expert_and_batches_stay_lossless(split_checkpoint):
    """theta = 0.25 everywhere: a hit (top cached) moves the bottom, 36 of 48 rows; a miss the whole expert.
    A batch needs more experts per layer than the buffer holds: they pass through it in turn."""
    manifest = read_manifest(split_checkpoint / "packed")
    expected = reference(split_checkpoint, (12,) * LAYERS)
    with OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget="100%", device="cpu",
                                 split_config=config([4] * LAYERS, [0.25] * LAYERS))) as engine:
        result = engine.generate(PROMPTS[1], max_new_tokens=NEW_TOKENS)
        stats = result.stats
        assert stats.hits > 0 and stats.misses > 0
        bottom = manifest.expert_bytes * 36 // 48
        assert stats.bytes_per_link == {"ssd->fast": stats.misses * manifest.expert_bytes + stats.hits * bottom}
        outs = engine.generate_batch(PROMPTS, max_new_tokens=NEW_TOKENS)
        assert [out.token_ids for out in outs] == [expected[prompt][0] for prompt in PROMPTS]


def test_ratio_one_is_the_unsplit_model_and_the_split_reference_is_close_to_it(split_checkpoint):
    unsplit = reference(split_checkpoint, None)
    whole = reference(split_checkpoint, (INTERMEDIATE,) * LAYERS)
    halves = reference(split_checkpoint, (24,) * LAYERS)
    for prompt in PROMPTS:
        assert whole[prompt][0] == unsplit[prompt][0]
        assert all(torch.equal(a, b) for a, b in zip(whole[prompt][1], unsplit[prompt][1]))
        difference = max(float((a - b).abs().max()) for a, b in zip(halves[prompt][1], unsplit[prompt][1]))
        assert difference < 1e-3  # rounding only: two GEMMs added instead of one


def test_a_bottom_changed_after_its_verified_read_is_caught(split_checkpoint, tmp_path):
    import shutil

    packed = tmp_path / "packed"
    shutil.copytree(split_checkpoint / "packed", packed)
    with OffloadEngine(make_plan(packed, fast_budget="100%", device="cpu",
                                 split_config=config([EXPERTS] * LAYERS, [0.5] * LAYERS))) as engine:
        engine.generate(PROMPTS[0], max_new_tokens=2)
        split = engine.split
        key = next(iter(split.tops[0].resident))
        manifest = read_manifest(packed)
        down = next(t for t in manifest.tensors if t.name == "down_proj")
        entry = manifest.experts[(0, key)]
        position = entry.offset + down.offset + (5 * INTERMEDIATE + 30) * 2  # row 5, a bottom column
        with open(manifest.layer_path(0), "r+b") as handle:
            handle.seek(position)
            byte = handle.read(1)
            handle.seek(position)
            handle.write(bytes([byte[0] ^ 0xFF]))
        slot = split.buffer.take()
        try:
            with pytest.raises(ExpertReadError, match=f"expert {key} of layer 0: .*bottom segment"):
                split._load(key, slot, whole=False)
        finally:
            split.buffer.give_back(slot)


@pytest.mark.parametrize("cached, ratios, problem", [
    ([2] * (LAYERS + 1), [0.5] * (LAYERS + 1), "4 layers, but the trace's model has 3"),
    ([EXPERTS + 1] + [2] * (LAYERS - 1), [0.5] * LAYERS, "layer 0: 7 cached experts"),
    ([EXPERTS] * LAYERS, [1.0] * LAYERS, "more than the fast budget"),
    ([2] * LAYERS, [0.001] * LAYERS, "holds no row"),
])
def test_a_split_config_the_model_or_budget_cannot_run_is_refused(split_checkpoint, cached, ratios, problem):
    with pytest.raises(ConfigError, match=problem):
        OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget="50%", device="cpu",
                                split_config=config(cached, ratios)))


def test_generate_split_config_errors_are_one_line(split_checkpoint, tmp_path, capsys):
    bad_ratio = tmp_path / "ratio.json"
    bad_ratio.write_text(json.dumps({"layers": [{"cache_size": 2, "split_ratio": 1.5}] * LAYERS}))
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"layers": [{"cache_size": 2, "split_ratio": 0.5}] * 2}))
    packed = str(split_checkpoint / "packed")
    for path, problem in [(bad_ratio, "split_ratio"), (short, "2 layers, but"), (tmp_path / "none.json", "none.json")]:
        code = main(["generate", "hi", "--model", packed, "--device", "cpu", "--split-config", str(path)])
        err = capsys.readouterr().err
        assert code == 2 and problem in err and str(path) in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match="does not preload"):
        OffloadEngine(make_plan(packed, fast_budget="100%", device="cpu", preload=True,
                                split_config=config([2] * LAYERS, [0.5] * LAYERS)))
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"layers": [{"cache_size": 3, "split_ratio": 0.5}] * LAYERS}))
    assert main(["generate", "def", "--model", packed, "--device", "cpu", "--split-config", str(good),
                 "--fast-budget", "100%", "--max-new-tokens", "3"]) == 0
    assert "9 cached tops and a buffer of 2 experts" in " ".join(capsys.readouterr().out.split())


def test_a_cached_top_computes_while_its_bottom_is_read(split_checkpoint):
    """Every top cached: each expert's top part is handed to the compute before its bottom's read ends. Forced, not
    timed: a bottom's read does not end until its top was handed over, which deadlocks (up to the hang guard) if
    the compute waited for the read."""
    import threading
    from collections import defaultdict

    with OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget="100%", device="cpu",
                                 split_config=config([EXPERTS] * LAYERS, [0.5] * LAYERS))) as engine:
        engine.generate(PROMPTS[0], max_new_tokens=3)  # the first reads are whole: every routed top is cached
        split, store = engine.split, engine.store
        events, never_handed, lock = [], [], threading.Lock()
        top_handed = defaultdict(threading.Event)
        read_runs, part_tensors = store.read_runs, split.part_tensors

        def read_ending_after_the_top(layer, expert, runs, into):
            key = layer * EXPERTS + expert
            with lock:
                handed = top_handed[key]
            if not handed.wait(RESULT_WAIT_S):
                never_handed.append(key)
            handed.clear()
            read_runs(layer, expert, runs, into)
            with lock:
                events.append(("bottom read", key))

        def logged_part_tensors(key, part):
            with lock:
                events.append((f"part {part}", key))
                if part == 0:
                    top_handed[key].set()
            return part_tensors(key, part)

        store.read_runs, split.part_tensors = read_ending_after_the_top, logged_part_tensors
        engine.generate(PROMPTS[0], max_new_tokens=3)
    assert not never_handed
    assert any(kind == "bottom read" for kind, _ in events)
    for i, (kind, key) in enumerate(events):
        if kind == "part 1":  # each bottom computed is one read before, and its top was handed over first
            assert events[:i].count(("bottom read", key)) >= events[:i + 1].count(("part 1", key))
            assert events[:i].count(("part 0", key)) >= events[:i + 1].count(("part 1", key))


def test_bottom_reads_retry_transient_errors_continue_short_reads_and_name_a_failing_expert(split_checkpoint):
    import errno
    import os

    from moe_offload.runtime.storage import ExpertStore

    packed = split_checkpoint / "packed"
    manifest = read_manifest(packed)
    calls = []

    def flaky_short(fd, view, offset):  # every 37th call fails with EIO; none reads more than 1000 bytes
        calls.append(offset)
        if len(calls) % 37 == 0:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return os.preadv(fd, [view[:1000]], offset)

    store = ExpertStore(manifest, read_into=flaky_short, backoff_s=0.0)
    expected = reference(split_checkpoint, (24,) * LAYERS)
    with OffloadEngine(make_plan(packed, fast_budget="100%", device="cpu",
                                 split_config=config([4] * LAYERS, [0.5] * LAYERS)), store=store) as engine:
        for prompt in PROMPTS:
            assert engine.generate(prompt, max_new_tokens=NEW_TOKENS).token_ids == expected[prompt][0]
        assert engine.stats.hits > 0 and store.retried > 0  # bottoms read alone (hits), reads retried

    def failing(fd, view, offset):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    store = ExpertStore(manifest, read_into=failing, retries=1, backoff_s=0.0)
    with OffloadEngine(make_plan(packed, fast_budget="100%", device="cpu",
                                 split_config=config([4] * LAYERS, [0.5] * LAYERS)), store=store) as engine:
        with pytest.raises(ExpertReadError, match=r"expert \d+ of layer \d+: .*\.bin \(bytes \d+..\d+\): read failed"):
            engine.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
        split = engine.split
        with split.cond:  # a read that started before the failure ends in one too: then nothing is left behind
            assert split.cond.wait_for(lambda: split.queue.on_wire is None, timeout=RESULT_WAIT_S)
            assert not split.buffer_slot and len(split.buffer.free) == TOP_K


@pytest.mark.parametrize("host_budget, prefetch", [("1B", None), ("25%", "moepic"), ("100%", None), ("100%", "moepic")])
def test_a_host_tier_between_the_files_and_the_split_stays_lossless(split_checkpoint, host_budget, prefetch):
    """The host tier holds whole experts as stored ("1B", one byte, rounds down to no expert: refused; one expert,
    a bare "1", is the least); loads come through it, lossless with and without prefetching, batches included."""
    if host_budget == "1B":
        with pytest.raises(ConfigError, match="cannot hold one expert"):
            OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget="100%", device="cpu", host_budget=host_budget,
                                    split_config=config([2] * LAYERS, [0.5] * LAYERS)))
        host_budget = "1"
    expected = reference(split_checkpoint, (24, 12, 36))
    with OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget="100%", device="cpu", host_budget=host_budget,
                                 prefetch=prefetch, split_config=config([2, 4, 3], [0.5, 0.25, 0.75]))) as engine:
        for prompt, (tokens, logits) in expected.items():
            result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, return_logits=True)
            assert result.token_ids == tokens
            assert all(torch.equal(a, b) for a, b in zip(result.logits, logits))
        outs = engine.generate_batch(PROMPTS, max_new_tokens=NEW_TOKENS)
        assert [out.token_ids for out in outs] == [expected[prompt][0] for prompt in PROMPTS]
        assert "ssd->fast" not in engine.stats.bytes_per_link  # every load came through the host tier


def test_the_host_tier_reads_each_expert_from_the_files_once_and_the_fast_memory_from_it(split_checkpoint):
    """All 18 experts fit in the host tier: the files give each routed expert once (ssd->host), the host tier
    gives the fast memory what the split loads (host->fast: a whole expert per miss, 24 of 48 rows per hit), and
    every demand load after an expert's first is a host hit."""
    manifest = read_manifest(split_checkpoint / "packed")
    with OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget="100%", device="cpu", host_budget="100%",
                                 split_config=config([2] * LAYERS, [0.5] * LAYERS))) as engine:
        for _ in range(2):
            engine.generate(PROMPTS[1], max_new_tokens=NEW_TOKENS)
        stats, host = engine.stats, engine.split.host
        first_reads = len(host)
        assert stats.bytes_per_link["ssd->host"] == first_reads * manifest.expert_bytes
        bottom = manifest.expert_bytes * 24 // 48
        assert stats.bytes_per_link["host->fast"] == stats.misses * manifest.expert_bytes + stats.hits * bottom
        assert stats.tier_requests["host"] == stats.on_demand_loads
        assert stats.tier_hits["host"] == stats.on_demand_loads - first_reads
