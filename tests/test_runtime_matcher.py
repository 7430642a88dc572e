"""fMoE in the runtime (issue 9.2, 9.3): the live view's per-token input embeddings against the recorder's, fMoE's
proposals in the runtime against the same prefetcher driven by the recorded trace, and the asynchronous
matcher (runtime/matcher.py): off the decode thread, never waited for, late results dropped and counted,
failures raised, generation lossless. Hit counts depend on timing under the asynchronous matcher, so the
tests check proposals (computed from snapshots, whatever the timing) and use a blocked matcher as the
synchronisation point."""

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from model_configs import build, tiny_tokenizer  # noqa: E402
from waits import RESULT_WAIT_S  # noqa: E402

from moe_offload.errors import ConfigError  # noqa: E402
from moe_offload.models.recorder import record  # noqa: E402
from moe_offload.prefetch import RoutingView, make_prefetcher  # noqa: E402
from moe_offload.prefetch.base import Proposal  # noqa: E402
from moe_offload.plan import make_plan  # noqa: E402
from moe_offload.runtime.engine import OffloadEngine  # noqa: E402
from moe_offload.runtime.live_view import LiveRoutingView  # noqa: E402
from moe_offload.plan.choices import MATCHERS  # noqa: E402
from moe_offload.text.prompts import Prompt  # noqa: E402

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog."]
NEW_TOKENS = 6
FAST = "40%"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny random Mixtral (3 layers x 6 experts, top-2) in float16, packed; the reference model; a history
    trace; and each prompt recorded alone (the trace the runtime's views must reproduce)."""
    root = tmp_path_factory.mktemp("matcher")
    model, _ = build("mixtral", seed=5)
    model.half().save_pretrained(root / "model")
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(root / "model")
    from moe_offload.models.adapters import load_model
    from moe_offload.runtime.packing import pack_model

    pack_model(root / "model", root / "packed")
    reference, adapter = load_model(root / "model")
    history = record(reference, adapter, tokenizer, [Prompt(p, f"h:{i}") for i, p in enumerate(PROMPTS * 2)],
                     model_name="tiny-random", max_new_tokens=4, batch_size=2).trace
    recorded = {p: record(reference, adapter, tokenizer, [Prompt(p, "p")], model_name="tiny-random",
                          max_new_tokens=NEW_TOKENS, batch_size=1).trace for p in PROMPTS}
    return {"packed": root / "packed", "history": history, "recorded": recorded}


def engine_of(setup, matcher="async", **options):
    return OffloadEngine(make_plan(setup["packed"], fast_budget=FAST, prefetch="fmoe", prefetch_history=setup["history"],
                                   prefetch_options=options or None, matcher=matcher))


def spy(prefetcher, seen: list, blocked: threading.Event | None = None):
    """Record every hook call's (hook, thread, view embedding, requests, proposals) on ``prefetcher``."""
    for hook in ("on_iteration_start", "on_layer_routed", "on_iteration_end"):
        original = getattr(prefetcher, hook)

        def wrapped(view, hook=hook, original=original):
            if blocked is not None:
                blocked.wait(timeout=RESULT_WAIT_S)  # released by the test; a guard against a hang
            embedding = view.embedding()
            proposals = original(view)
            seen.append((hook, threading.current_thread(), None if embedding is None else embedding.copy(),
                         np.array(view.requests), view.layer_now, proposals))
            return proposals
        setattr(prefetcher, hook, wrapped)


def iterations(trace):
    return [np.flatnonzero(trace.iteration == i) for i in np.unique(trace.iteration)]


@pytest.mark.parametrize("matcher", MATCHERS)
def test_the_prefetcher_sees_each_tokens_input_embedding_as_the_recorder_records_it(setup, matcher):
    prompt = PROMPTS[1]
    trace = setup["recorded"][prompt]
    seen = []
    with engine_of(setup, matcher) as engine:
        spy(engine.prefetcher, seen)
        engine.generate(prompt, max_new_tokens=NEW_TOKENS)
    starts = [embedding for hook, _, embedding, *_ in seen if hook == "on_iteration_start"]
    rows = iterations(trace)
    assert len(starts) == len(rows) == NEW_TOKENS
    for embedding, iteration_rows in zip(starts, rows):
        assert np.array_equal(embedding, trace.embedding[iteration_rows].astype(np.float32))
    assert starts[0].shape[0] > 1 and all(e.shape[0] == 1 for e in starts[1:])
    decode = [e[0] for e in starts[1:]]
    assert all(not np.array_equal(a, b) for a, b in zip(decode, decode[1:]))  # a new token, a new embedding


def test_packed_passes_hand_each_row_its_own_tokens_embedding(setup):
    seen = []
    with engine_of(setup, "lockstep") as engine:
        spy(engine.prefetcher, seen)
        completions = engine.generate_batch(PROMPTS, max_new_tokens=NEW_TOKENS)
    starts = [(embedding, requests) for hook, _, embedding, requests, *_ in seen if hook == "on_iteration_start"]
    assert any(len(set(requests.tolist())) > 1 for _, requests in starts)  # passes held both requests
    for prompt, completion in zip(PROMPTS, completions):
        trace = setup["recorded"][prompt]
        rows = np.concatenate([embedding[requests == completion.request] for embedding, requests in starts])
        assert np.array_equal(rows, trace.embedding.astype(np.float32))  # prefill rows, then each new token's


def drive_on_trace(prefetcher, trace):
    """The simulators' seam: every hook over the recorded trace's iterations, as (hook, layer, proposals)."""
    out = []
    for iteration, rows in enumerate(iterations(trace)):
        view = RoutingView(trace, iteration, rows)
        out.append(("on_iteration_start", -1, prefetcher.on_iteration_start(view)))
        for layer in range(trace.meta.num_layers):
            view.layer_now = layer
            out.append(("on_layer_routed", layer, prefetcher.on_layer_routed(view)))
        prefetcher.on_iteration_end(view)
    return out


@pytest.mark.parametrize("matcher", MATCHERS)
def test_fmoe_proposes_in_the_runtime_what_it_proposes_on_the_recorded_trace(setup, matcher):
    """Distance 1: every layer after the first is predicted by a trajectory search over the live router
    distributions, and the store grows with the run's own iterations. The trace holds float16 copies of the
    distributions the runtime sees in float32: the same experts, priorities within float16's precision."""
    seen = []
    with engine_of(setup, matcher, distance=1) as engine:
        spy(engine.prefetcher, seen)
        for prompt in PROMPTS:
            engine.generate(prompt, max_new_tokens=NEW_TOKENS)
    live = [(hook, layer, proposals) for hook, _, _, _, layer, proposals in seen if hook != "on_iteration_end"]
    reference = make_prefetcher("fmoe", engine.spec, {"distance": 1})
    reference.fit(setup["history"])
    expected = []
    for prompt in PROMPTS:
        expected += drive_on_trace(reference, setup["recorded"][prompt])
        reference.on_request_end(0)
    assert [(hook, layer) for hook, layer, _ in live] == [(hook, layer) for hook, layer, _ in expected]
    assert sum(len(p) for _, _, p in live) > 0
    for (_, _, got), (_, _, want) in zip(live, expected):
        assert [p.key for p in got] == [p.key for p in want]
        assert np.allclose([p.priority for p in got], [p.priority for p in want], rtol=2e-3)


def test_the_matcher_runs_off_the_decode_thread_which_never_waits_for_it(setup):
    """The matcher is blocked in its first hook while the scheduler generates a whole request: the tokens come
    (the decode thread did not wait), and once released every result is for a pass that is over: late."""
    seen, release = [], threading.Event()
    with engine_of(setup, "async") as engine:
        spy(engine.prefetcher, seen, blocked=release)
        with OffloadEngine(make_plan(setup["packed"], fast_budget=FAST)) as plain:
            expected = plain.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS).token_ids
        completion = engine.generate_batch([PROMPTS[0]], max_new_tokens=NEW_TOKENS)[0]
        assert seen == [] and completion.token_ids == expected
        release.set()
        engine.runner.wait_for_matcher()
        late, arrived = engine.late_proposals
        assert arrived > 0 and late == arrived
        assert engine.stats.prefetches_issued == 0
    assert {thread for _, thread, *_ in seen} == {engine.runner.matcher._thread}
    assert [hook for hook, *_ in seen].count("on_iteration_end") == NEW_TOKENS


def test_results_for_routed_layers_or_ended_passes_are_dropped_and_counted(setup):
    with engine_of(setup, "async") as engine:
        runner, path, J = engine.runner, engine.path, engine.spec.num_experts
        view = LiveRoutingView(engine.spec, 7, np.zeros(1, np.int64), np.zeros(1, np.int64), False, None, "test")
        view.layer_now = 0
        runner.view = view
        runner._deliver(7, [Proposal(0 * J + 1, 1.0), Proposal(1 * J + 2, 0.5), Proposal(2 * J + 3, 0.25)])
        runner._deliver(6, [Proposal(2 * J + 4, 1.0)])  # a pass that is over
        assert engine.late_proposals == (2, 4)
        with path.cond:
            while path.busy():
                path.cond.wait()
        fast = engine.tiers[0].cache
        assert {1 * J + 2, 2 * J + 3} <= set(fast.resident) and not {0 * J + 1, 2 * J + 4} & set(fast.resident)
        assert engine.stats.prefetches_issued == 2


def test_a_matcher_failure_is_raised_on_the_decode_thread_and_the_engine_goes_on(setup):
    with engine_of(setup, "async") as engine:
        original = engine.prefetcher.on_layer_routed

        def failing(view):
            raise ConfigError("the store is broken")
        engine.prefetcher.on_layer_routed = failing
        with pytest.raises(ConfigError, match="the store is broken"):
            engine.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
        engine.prefetcher.on_layer_routed = original
        assert len(engine.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS).token_ids) == NEW_TOKENS


def test_generation_is_lossless_whatever_the_matcher(setup):
    with OffloadEngine(make_plan(setup["packed"], fast_budget="100%", preload=True)) as resident:
        expected = [resident.generate(p, max_new_tokens=NEW_TOKENS, return_logits=True) for p in PROMPTS]
        batched = [c.token_ids for c in resident.generate_batch(PROMPTS, max_new_tokens=NEW_TOKENS)]
    for matcher in MATCHERS:
        with engine_of(setup, matcher) as engine:
            for prompt, want in zip(PROMPTS, expected):
                got = engine.generate(prompt, max_new_tokens=NEW_TOKENS, return_logits=True)
                assert got.token_ids == want.token_ids
                assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
            assert [c.token_ids for c in engine.generate_batch(PROMPTS, max_new_tokens=NEW_TOKENS)] == batched


def test_a_bad_matcher_mode_is_refused(setup):
    with pytest.raises(ConfigError, match="matcher 'threads': choose from async, inline, lockstep"):
        engine_of(setup, "threads")


def test_generate_command_takes_the_matcher_and_reports_late_proposals(setup, tmp_path, capsys):
    from moe_offload.cli.main import main
    from moe_offload.trace.format import write_trace

    history = write_trace(setup["history"], tmp_path / "history.parquet")
    command = ["generate", "--model", str(setup["packed"]), "--fast-budget", FAST, "--prefetch", "fmoe",
               "--prefetch-history", str(history), "--max-new-tokens", "4", PROMPTS[0]]
    assert main(command[:-1] + ["--matcher", "lockstep", PROMPTS[0]]) == 0
    assert "matcher: 0 of " in capsys.readouterr().out  # waited for: never late
    with pytest.raises(SystemExit):
        main(command[:-1] + ["--matcher", "threads", PROMPTS[0]])
    assert "invalid choice: 'threads'" in capsys.readouterr().err
