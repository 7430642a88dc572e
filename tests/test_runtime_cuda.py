"""The runtime's CUDA path: lossless against the all-resident engine on the same GPU and dtype, the pinned ring
reused, transfers overlapping compute. Skipped without CUDA (the machine that wrote them had none: they have
not run yet)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from model_configs import build, tiny_tokenizer  # noqa: E402

from moe_offload.models.recorder import record  # noqa: E402
from moe_offload.runtime.mover import RING_BUFFERS  # noqa: E402
from moe_offload.plan import make_plan  # noqa: E402
from moe_offload.runtime.engine import OffloadEngine  # noqa: E402
from moe_offload.runtime.packing import pack_model  # noqa: E402
from moe_offload.text.prompts import Prompt  # noqa: E402

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog."]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda")
    model, adapter = build("mixtral", seed=3)
    model.half().save_pretrained(root / "model")
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(root / "model")
    pack_model(root / "model", root / "packed")
    trace = record(model, adapter, tokenizer, [Prompt(p, f"p:{i}") for i, p in enumerate(PROMPTS)],
                   model_name="tiny-random", max_new_tokens=NEW_TOKENS, batch_size=1).trace
    with OffloadEngine(make_plan(root / "packed", fast_budget="100%", preload=True, device="cuda")) as engine:
        expected = {p: engine.generate(p, max_new_tokens=NEW_TOKENS, return_logits=True) for p in PROMPTS}
    return root / "packed", expected, trace


@pytest.mark.parametrize("policy, prefetch, budget, host", [("lru", None, "25%", None), ("lcp", "moepic", "30%", None),
                                                            ("fmoe", "topk", "40%", "50%"), ("lru", None, "12%", "100%")])
def test_lossless_against_the_all_resident_engine_on_the_same_gpu(packed, policy, prefetch, budget, host):
    directory, expected, _ = packed
    with OffloadEngine(make_plan(directory, fast_budget=budget, host_budget=host, policy=policy, prefetch=prefetch,
                                 device="cuda")) as engine:
        assert engine.compute_dtype == torch.float16
        for prompt, reference in expected.items():
            result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, return_logits=True)
            assert result.token_ids == reference.token_ids
            assert all(torch.equal(a, b) for a, b in zip(result.logits, reference.logits))


def test_the_pinned_ring_is_reused_and_gpu_memory_does_not_grow(packed):
    directory, _, _ = packed
    with OffloadEngine(make_plan(directory, fast_budget="25%", device="cuda")) as engine:
        engine.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        for prompt in PROMPTS * 2:
            engine.generate(prompt, max_new_tokens=NEW_TOKENS)
        torch.cuda.synchronize()
        mover = engine.path.workers[0].mover
        assert engine.stats.misses > 3 * RING_BUFFERS  # many experts went through the ring ...
        assert mover.ring_allocations == RING_BUFFERS  # ... and it was allocated once
        assert torch.cuda.memory_allocated() <= allocated + (1 << 20)  # experts live in the slots, not new memory


def test_transfers_overlap_compute(packed):
    """Under routing replay the oracle prefetches the next layers while this one computes: the time the link
    spent copying exceeds the time the compute waited for it."""
    directory, _, trace = packed
    with OffloadEngine(make_plan(directory, fast_budget="30%", policy="lru", prefetch="oracle", replay=trace,
                                 device="cuda")) as engine:
        result = engine.generate_replayed(0)
        busy = sum(engine.counters.link_busy_seconds.values())
    assert result.stats.prefetches_used > 0
    assert result.stats.stall_seconds < busy
    assert np.isfinite(result.stats.tpot_seconds)


@pytest.mark.parametrize("policy, budget", [("static-layers", "34%"), ("static-freq", "25%")])
def test_bypassed_experts_computed_on_the_host_agree_with_the_gpu(packed, tmp_path, policy, budget):
    """A placement's other experts computed on the CPU from pinned host copies (models/host_experts.py): CPU
    kernels do not give the GPU's bits, so the logits agree within float16 rounding and the tokens are equal."""
    from moe_offload.trace.format import write_trace

    directory, expected, trace = packed
    options = {}
    if policy == "static-freq":
        options = {"profile": str(write_trace(trace, tmp_path / "profile.parquet"))}
    with OffloadEngine(make_plan(directory, fast_budget=budget, policy=policy, policy_options=options, device="cuda")) as engine:
        assert engine.tiers[-1].pool.memory.is_pinned()
        for prompt, reference in expected.items():
            result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, return_logits=True)
            assert result.token_ids == reference.token_ids
            for ours, theirs in zip(result.logits, reference.logits):
                torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)
            assert result.stats.bypassed > 0 and result.stats.host_compute_seconds > 0


def test_fetch_or_compute_computes_the_misses_on_the_host_and_agrees_with_the_gpu(packed):
    """Fiddler's rule with a GPU expert of 1 ms against a host expert of 1 us and a link of 1 us: every miss is
    computed on the CPU from the pinned host tier (fetch >= 1 ms > compute), as the static placements above."""
    from test_runtime_fetch_or_compute import profile

    directory, expected, _ = packed
    cheap_host = profile(gpu_expert=1e-3, host_fixed=1e-6, latency=1e-6, bandwidth=1e9)
    with OffloadEngine(make_plan(directory, fast_budget="25%", policy="lru", fetch_or_compute=True, hardware=cheap_host,
                                 device="cuda")) as engine:
        for prompt, reference in expected.items():
            result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, return_logits=True)
            assert result.token_ids == reference.token_ids
            for ours, theirs in zip(result.logits, reference.logits):
                torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)
            assert result.stats.bypassed == result.stats.accesses > 0
