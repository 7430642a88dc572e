"""Continuous batching in the runtime (runtime/batching.py, runtime/packed.py): each request's tokens and
logits are those it gets alone, bit for bit on CPU float32, whatever joins and leaves around it; a batch
fetches the union of its experts once; per-request state ends with the request; a failing expert fails
only the requests that need it."""

from __future__ import annotations

import shutil
import signal
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moe_offload.api import load  # noqa: E402
from moe_offload.errors import ConfigError, MoeOffloadError  # noqa: E402
from moe_offload.runtime.requests import SamplingParams  # noqa: E402
from moe_offload.runtime.pack_cache import packed_directory  # noqa: E402
from moe_offload.runtime.packing import read_manifest  # noqa: E402
from moe_offload.runtime.storage import ExpertReadError  # noqa: E402
from waits import RESULT_WAIT_S  # noqa: E402

PROMPTS = ["User: what is a cache?\nAssistant:", "User: hi\nAssistant:",
           "User: tell me about the history of Rome, its emperors and its roads\nAssistant:",
           "def add(a, b):", "The quick brown fox"]
NEW_TOKENS = [12, 7, 10, 5, 9]


class BatchSizes:
    def __init__(self):
        self.sizes = []

    def on_pass(self, batch, seconds):
        self.sizes.append(batch)

    def on_finish(self, completion):
        pass


@pytest.fixture(scope="module")
def alone():
    """Each prompt's greedy tokens and logits when it runs alone (transformers' generate)."""
    with load("tiny", fast_budget="30%", policy="lru") as engine:
        return [engine.generate(p, max_new_tokens=n, return_logits=True) for p, n in zip(PROMPTS, NEW_TOKENS)]


def assert_same(completion, reference):
    assert completion.token_ids == reference.token_ids
    assert len(completion.logits) == len(reference.logits)
    assert all(torch.equal(a, b) for a, b in zip(completion.logits, reference.logits))
    assert completion.text == reference.text


def staggered(engine) -> list:
    """PROMPTS through ``engine`` (max_batch 3): two start, the others join while they decode, wait for a free
    slot, take the slots of requests that left (the KV pool's reused slots and holes); their Completions."""
    sizes = BatchSizes()
    engine.scheduler.observers.append(sizes)
    first = [engine.submit(p, SamplingParams(max_tokens=n, return_logits=True))
             for p, n in zip(PROMPTS[:2], NEW_TOKENS[:2])]
    stream = iter(first[0])
    for _ in range(3):  # the others join while the first two are decoding
        next(stream)
    later = [engine.submit(p, SamplingParams(max_tokens=n, return_logits=True))
             for p, n in zip(PROMPTS[2:], NEW_TOKENS[2:])]
    completions = [handle.result(timeout=RESULT_WAIT_S) for handle in first + later]
    assert max(sizes.sizes) == 3 and sizes.sizes[0] <= 2 and sizes.sizes[-1] == 1  # joined, waited, left
    return completions


@pytest.mark.parametrize("prefetch", [None, "moepic"])
def test_greedy_outputs_under_concurrent_load_equal_each_request_alone_bit_for_bit(alone, prefetch):
    with load("tiny", fast_budget="30%", policy="lru", prefetch=prefetch, max_batch=3) as engine:
        completions = staggered(engine)
    for completion, reference in zip(completions, alone):
        assert completion.finish_reason == "length"
        assert_same(completion, reference)


def test_generate_runs_on_the_engines_computing_thread_between_iterations(alone):
    """One thread computes (the scheduler's, runtime/batching.py): generate runs there as a job between two
    iterations of a running batch, and both give what each gives alone."""
    threads = set()
    with load("tiny", fast_budget="30%", policy="lru") as engine:
        batched = engine.submit(PROMPTS[1], SamplingParams(max_tokens=NEW_TOKENS[1], return_logits=True))
        next(iter(batched))  # the batch is running
        single = engine.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS[0], return_logits=True,
                                 on_text=lambda text: threads.add(threading.current_thread().name))
        assert_same(single, alone[0])
        assert_same(batched.result(timeout=RESULT_WAIT_S), alone[1])
    assert threads == {"moe-offload compute"}


@pytest.fixture
def sigint_raises():
    """SIGINT raising KeyboardInterrupt in the main thread, as in an interactive run: Python installs that
    handler only if SIGINT was not ignored when it started, and a shell starts a background job (`pytest &`,
    nohup) with SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupted_generate_stops_at_the_next_token_and_the_engine_serves_on(alone, sigint_raises):
    """Ctrl-C while generate waits for the computing thread: the generation stops after the token being made,
    the interruption reaches the caller, and the engine generates as before. Forced, not timed: the signal goes
    to the main thread (where Python handles it), and the computing thread makes no further token until the
    interruption has reached the generation."""
    tokens, cancels, handled = [], [], []

    def interrupt_after_two(text):
        tokens.append(text)
        if len(tokens) == 2:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # as Ctrl-C
            handled.append(cancels[0].wait(RESULT_WAIT_S))

    with load("tiny", fast_budget="30%", policy="lru") as engine:
        generate = engine._generate

        def generate_keeping_its_cancel(*args):
            cancels.append(args[-1])
            return generate(*args)

        engine._generate = generate_keeping_its_cancel
        with pytest.raises(KeyboardInterrupt):
            engine.generate(PROMPTS[2], max_new_tokens=40, on_text=interrupt_after_two)
        assert handled == [True] and 2 <= len(tokens) < 40
        assert_same(engine.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS[0], return_logits=True), alone[0])


def test_an_interrupt_before_the_computing_thread_takes_the_job_drops_it():
    """Ctrl-C landing while the call is being queued (the scheduler's lock still held): the job leaves the queue
    unrun, the interruption reaches the caller, and the engine serves on."""
    ran = []
    with load("tiny", fast_budget="30%", policy="lru") as engine:
        scheduler = engine.scheduler
        assert scheduler.run(len, "up") == 2  # the computing thread runs, waiting for work
        start = scheduler._start

        def start_then_interrupted():
            start()
            raise KeyboardInterrupt  # as a signal landing here, before the thread is told of the job

        scheduler._start = start_then_interrupted
        with pytest.raises(KeyboardInterrupt):
            scheduler.run(ran.append, "ran")
        scheduler._start = start
        assert scheduler.run(len, "ok") == 2 and ran == [] and not scheduler.jobs


def test_a_batch_fetches_the_union_of_its_experts_once():
    prompt, n = PROMPTS[0], 6
    with load("tiny", fast_budget="100%", policy="lru") as engine:
        single = engine.generate_batch([prompt], max_new_tokens=n)[0]
        one = engine.stats
    with load("tiny", fast_budget="100%", policy="lru", max_batch=2) as engine:
        pair = engine.generate_batch([prompt, prompt], max_new_tokens=n)
        two = engine.stats
    # identical requests in the same passes: the same experts, each accessed and loaded once per pass
    assert two.accesses == one.accesses and two.on_demand_loads == one.on_demand_loads > 0
    for completion in pair:
        assert completion.token_ids == single.token_ids
        assert completion.stats.accesses == single.stats.accesses == one.accesses
        assert completion.stats.hits == single.stats.hits


def test_seeded_sampling_is_the_same_whatever_else_runs():
    params = dict(max_tokens=10, temperature=1.0, top_p=0.9)
    with load("tiny", fast_budget="50%", max_batch=4) as engine:
        alone = engine.submit(PROMPTS[0], SamplingParams(seed=7, **params)).result(timeout=RESULT_WAIT_S)
        crowd = [engine.submit(p, SamplingParams(seed=s, **params)) for p, s in
                 [(PROMPTS[1], 1), (PROMPTS[0], 7), (PROMPTS[2], 2), (PROMPTS[0], 8)]]
        results = [handle.result(timeout=RESULT_WAIT_S) for handle in crowd]
    assert results[1].token_ids == alone.token_ids
    assert results[3].token_ids != alone.token_ids  # another seed draws other tokens


def test_the_extra_sampling_parameters_of_a_request_stay_its_own():
    # top_k 1 at temperature 1 is the greedy answer; a repetition penalty and min-p change only their request's
    # tokens: each request of the crowd equals the same request alone
    greedy = SamplingParams(max_tokens=10)
    own = [SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=3),
           SamplingParams(max_tokens=10, repetition_penalty=1.5),
           SamplingParams(max_tokens=10, temperature=1.0, min_p=0.2, seed=5)]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    with load("tiny", fast_budget="50%", max_batch=4) as engine:
        plain = engine.submit(PROMPTS[0], greedy).result(timeout=RESULT_WAIT_S)
        alone = [engine.submit(p, params).result(timeout=RESULT_WAIT_S) for p, params in zip(prompts[1:], own)]
        penalised = engine.submit(PROMPTS[1], greedy).result(timeout=RESULT_WAIT_S)
        crowd = [engine.submit(p, params) for p, params in zip(prompts, [greedy, *own])]
        results = [handle.result(timeout=RESULT_WAIT_S) for handle in crowd]
    assert alone[0].token_ids == plain.token_ids  # top_k 1: greedy whatever the temperature and seed
    assert alone[1].token_ids != penalised.token_ids  # the penalty changed that request's greedy answer
    assert results[0].token_ids == plain.token_ids
    assert [r.token_ids for r in results[1:]] == [a.token_ids for a in alone]


def test_stop_sequences_end_the_text_before_them(alone):
    reference = alone[0]
    stop = reference.text[len(reference.text) // 2:][:3]
    assert stop.strip()
    with load("tiny", fast_budget="50%") as engine:
        handle = engine.submit(PROMPTS[0], SamplingParams(max_tokens=NEW_TOKENS[0], stop=(stop, "never seen")))
        streamed = "".join(delta.text for delta in handle)
        completion = handle.result()
    cut = reference.text.index(stop)
    assert completion.finish_reason == "stop"
    assert completion.text == streamed == reference.text[:cut]
    assert completion.token_ids == reference.token_ids[:len(completion.token_ids)]
    assert len(completion.token_ids) < len(reference.token_ids)


def test_per_sequence_state_ends_when_the_request_leaves():
    seen = []
    with load("tiny", fast_budget="30%", policy="moe-infinity", prefetch="moe-infinity", max_batch=3) as engine:
        policy = engine.tiers[0].cache.policy
        original = policy.on_access

        def spy(key, ctx):
            seen.append(dict(ctx.routed))
            original(key, ctx)

        policy.on_access = spy
        handles = [engine.submit(p, SamplingParams(max_tokens=n)) for p, n in zip(PROMPTS[:3], NEW_TOKENS[:3])]
        for handle in handles:
            handle.result(timeout=RESULT_WAIT_S)
        assert policy.sequences.by_request == {}
        assert engine.prefetcher._current == {}
        assert engine.runner.request_counters == {}
    requests = {handle.request for handle in handles}
    assert any(len(routed) > 1 for routed in seen)  # an access carried several requests' tokens
    assert set().union(*seen) == requests


def test_cancelled_requests_leave_at_the_next_iteration():
    with load("tiny", fast_budget="50%", max_batch=2) as engine:
        handle = engine.submit(PROMPTS[0], SamplingParams(max_tokens=200))
        other = engine.submit(PROMPTS[1], SamplingParams(max_tokens=5))
        next(iter(handle))
        handle.cancel()
        completion = handle.result(timeout=RESULT_WAIT_S)
        assert completion.finish_reason == "cancelled" and len(completion.token_ids) < 200
        assert other.result(timeout=RESULT_WAIT_S).finish_reason == "length"
        assert engine.scheduler.queued == (0, 0)


def test_cancels_racing_the_scheduler_never_lose_a_request_or_its_slot():
    """Cancels from other threads at arbitrary moments (the disconnect storm of issue 23): every request still
    ends, and every KV slot is free afterwards. Before cancel() took the scheduler's lock, a cancel between
    the loop's two reads of the flag dropped a request without ending it and leaked its slot."""
    with load("tiny", fast_budget="50%", max_batch=3) as engine:
        scheduler = engine.scheduler
        for _ in range(6):  # main's code before the fix lost a request in about one run of three rounds in two
            handles = [engine.submit(PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=40)) for i in range(12)]
            cancellers = [threading.Timer(0.002 * i, handle.cancel) for i, handle in enumerate(handles)]
            for canceller in cancellers:
                canceller.start()
            ends = [handle.result(timeout=RESULT_WAIT_S).finish_reason for handle in handles]
            for canceller in cancellers:
                canceller.join()
            assert set(ends) <= {"cancelled", "length", "stop"}
            assert scheduler.queued == (0, 0)
            assert scheduler.kv.available == scheduler.kv.slots
        assert engine.submit(PROMPTS[1], SamplingParams(max_tokens=3)).result(timeout=RESULT_WAIT_S).finish_reason == "length"


def test_a_request_without_a_free_kv_slot_waits_for_one():
    with load("tiny", fast_budget="50%", max_batch=2) as engine:
        scheduler = engine.scheduler
        with scheduler.cond:
            taken = scheduler.kv.acquire()  # one slot held elsewhere: one request runs at a time
        handles = [engine.submit(p, SamplingParams(max_tokens=4)) for p in PROMPTS[:2]]
        assert [h.result(timeout=RESULT_WAIT_S).finish_reason for h in handles] == ["length", "length"]
        assert scheduler.failure is None
        scheduler.kv.release(taken)


def test_a_dead_scheduler_fails_every_request_and_refuses_new_ones():
    with load("tiny", fast_budget="50%", max_batch=2) as engine:
        scheduler = engine.scheduler

        def broken_acquire():
            raise RuntimeError("the pool is corrupt")

        scheduler.kv.acquire = broken_acquire
        with scheduler.cond:  # all three wait when the scheduler dies
            handles = [engine.submit(p, SamplingParams(max_tokens=4)) for p in PROMPTS[:3]]
        ends = [handle.result(timeout=RESULT_WAIT_S) for handle in handles]
        assert [c.finish_reason for c in ends] == ["error"] * 3
        assert all("corrupt" in str(c.error) for c in ends)
        assert "corrupt" in str(scheduler.failure)
        with pytest.raises(MoeOffloadError, match="scheduler stopped.*corrupt"):
            engine.submit(PROMPTS[0], SamplingParams(max_tokens=2))


def test_bad_parameters_are_refused_before_any_work():
    with load("tiny", fast_budget="50%") as engine:
        for params, problem in [(SamplingParams(max_tokens=0), "max_tokens"),
                                (SamplingParams(top_p=0.0), "top_p"),
                                (SamplingParams(temperature=-1.0), "temperature"),
                                (SamplingParams(max_tokens=5000), "context")]:
            with pytest.raises(ConfigError, match=problem):
                engine.submit(PROMPTS[0], params)
        with pytest.raises(ConfigError, match="context"):
            engine.submit("word " * 2000, SamplingParams(max_tokens=1))
        assert engine.scheduler.queued == (0, 0)


def test_a_failing_expert_fails_only_the_requests_that_need_it(alone, tmp_path):
    source = packed_directory("tiny")
    packed = tmp_path / "packed"
    shutil.copytree(source, packed)
    manifest = read_manifest(packed)
    # the experts each prompt routes to at layer 3, from a run on the intact pack
    routed: dict[int, set] = {}
    with load("tiny", fast_budget="100%", max_batch=len(PROMPTS)) as engine:
        policy = engine.tiers[0].cache.policy
        original = policy.on_access
        lock = threading.Lock()

        def spy(key, ctx):
            with lock:
                for request in ctx.routed:
                    routed.setdefault(request, set()).add(key)
            original(key, ctx)

        policy.on_access = spy
        handles = [engine.submit(p, SamplingParams(max_tokens=n)) for p, n in zip(PROMPTS, NEW_TOKENS)]
        for handle in handles:
            handle.result(timeout=RESULT_WAIT_S)
    needs = [routed[handle.request] for handle in handles]
    J = manifest.num_experts
    candidates = [key for key in range(3 * J, 4 * J) if 0 < sum(key in n for n in needs) < len(needs)]
    victim = candidates[0]
    layer_file = manifest.layer_path(3)
    data = bytearray(layer_file.read_bytes())
    data[(victim - 3 * J) * manifest.expert_bytes + 5] ^= 0xFF
    layer_file.write_bytes(bytes(data))
    from moe_offload.plan import make_plan
    from moe_offload.runtime.engine import OffloadEngine

    with OffloadEngine(make_plan(packed, fast_budget="100%", max_batch=len(PROMPTS))) as engine:
        handles = [engine.submit(p, SamplingParams(max_tokens=n, return_logits=True))
                   for p, n in zip(PROMPTS, NEW_TOKENS)]
        completions = [handle.result(timeout=RESULT_WAIT_S) for handle in handles]
        after = engine.generate_batch([PROMPTS[i] for i, n in enumerate(needs) if victim not in n][:1],
                                      max_new_tokens=3)[0]
    for completion, need, reference in zip(completions, needs, alone):
        if victim in need:
            assert completion.finish_reason == "error"
            assert isinstance(completion.error, ExpertReadError)
            assert "layer003.bin" in str(completion.error) and "checksum" in str(completion.error)
        else:
            assert completion.finish_reason == "length"
            assert_same(completion, reference)
    assert after.finish_reason == "length"  # the engine serves on


def test_a_fault_outside_the_experts_fails_its_batch_and_the_scheduler_serves_on(alone):
    """Out of memory growing the KV pool (inside the pass): the requests of that iteration end with the error;
    a fault in one request's step after it (sampling, detokenising): that request alone. Later requests are
    served as alone."""
    with load("tiny", fast_budget="30%", policy="lru") as engine:
        scheduler = engine.scheduler
        reserve, advance = scheduler.kv.reserve, scheduler._advance
        faults = iter([("reserve", MemoryError("no room for the KV pool")),
                       ("advance", RuntimeError("the detokeniser broke"))])

        def failing_reserve(*args):
            scheduler.kv.reserve = reserve
            raise fault

        def failing_advance(*args):
            scheduler._advance = advance
            raise fault

        for where, fault in faults:
            if where == "reserve":
                scheduler.kv.reserve = failing_reserve
            else:
                scheduler._advance = failing_advance
            with scheduler.cond:  # both join the same iteration
                handles = [engine.submit(p, SamplingParams(max_tokens=4)) for p in PROMPTS[:2]]
            ends = [handle.result(timeout=RESULT_WAIT_S) for handle in handles]
            failed = ends if where == "reserve" else ends[:1]  # a request's own step fails it alone
            assert [c.finish_reason for c in ends] == ["error"] * len(failed) + ["length"] * (2 - len(failed))
            assert all(c.error is fault for c in failed)
            assert sorted(scheduler.kv.free) == list(range(scheduler.kv.slots))  # their slots are free again
            served = engine.submit(PROMPTS[0], SamplingParams(max_tokens=NEW_TOKENS[0], return_logits=True)
                                   ).result(timeout=RESULT_WAIT_S)
            assert served.finish_reason == "length"
            assert_same(served, alone[0])


@pytest.mark.parametrize("joining", [False, True])
def test_fast_batch_math_agrees_up_to_rounding(alone, joining):
    with load("tiny", fast_budget="30%", policy="lru", max_batch=3 if joining else len(PROMPTS),
              batch_math="fast") as engine:
        if joining:  # slots reused and left with holes, passes mixing prompts and decoding requests
            completions = staggered(engine)
        else:
            completions = engine.generate_batch(PROMPTS, max_new_tokens=max(NEW_TOKENS), return_logits=True)
    for completion, reference in zip(completions, alone):
        assert torch.allclose(completion.logits[0], reference.logits[0], rtol=1e-4, atol=1e-4)
        same = next((i for i, (a, b) in enumerate(zip(completion.token_ids, reference.token_ids)) if a != b),
                    len(reference.token_ids))
        for a, b in zip(completion.logits[:same + 1], reference.logits[:same + 1]):  # up to the first divergence
            assert torch.allclose(a, b, rtol=1e-3, atol=1e-3)
    with pytest.raises(ConfigError, match="batch_math"):
        load("tiny", batch_math="quick")
