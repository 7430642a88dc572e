"""One request's sampling (runtime/sampling.py) against hand-worked numbers: tiny temperatures are greedy
(no NaN), OpenAI's presence and frequency penalties and logit bias, vLLM's repetition penalty, min-p and
top-k, log-probabilities of the raw logits."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from moe_offload.runtime.requests import SamplingParams  # noqa: E402
from moe_offload.runtime.sampling import adjusted, sample, token_logprobs, truncated  # noqa: E402


def generator(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-30, 1e-8])
def test_a_tiny_temperature_is_the_greedy_choice(temperature):
    logits = torch.tensor([0.5, 3.0, 2.999, -1.0])
    params = SamplingParams(temperature=temperature, top_p=0.9)
    assert {sample(logits, params, generator(seed), []) for seed in range(20)} == {1}


def test_neutral_parameters_leave_the_logits_as_they_are():
    logits = torch.tensor([1.0, 2.0])
    assert adjusted(logits, SamplingParams(), [0, 1, 1]) is logits


def test_penalties_and_bias_follow_openais_formula():
    logits = torch.tensor([1.0, 0.9, 0.0])
    # token 0 generated twice: 1.0 - 2 * 0.1 (frequency) - 0.05 (presence) = 0.75; token 1 once: 0.9 - 0.15
    params = SamplingParams(frequency_penalty=0.1, presence_penalty=0.05, logit_bias={2: 0.5})
    assert adjusted(logits, params, [0, 1, 0]).tolist() == pytest.approx([0.75, 0.75, 0.5])
    assert sample(logits, SamplingParams(frequency_penalty=0.1), generator(), [0, 0]) == 1  # 0.8 < 0.9
    assert sample(logits, SamplingParams(presence_penalty=0.2), generator(), [0]) == 1
    assert sample(logits, SamplingParams(logit_bias={2: 100}), generator(), []) == 2
    assert sample(logits, SamplingParams(frequency_penalty=-1.0), generator(), [1]) == 1  # 1.9: encouraged


def test_logprobs_are_the_models_distribution():
    logits = torch.tensor([0.0, math.log(3.0), -math.inf])  # probabilities 1/4, 3/4, 0
    chosen, top = token_logprobs(logits, 0, 2)
    assert chosen == pytest.approx(math.log(0.25))
    assert [t for t, _ in top] == [1, 0] and top[0][1] == pytest.approx(math.log(0.75))
    assert token_logprobs(logits, 1, 0) == (pytest.approx(math.log(0.75)), [])


def test_parameters_out_of_range_are_refused():
    from moe_offload.errors import ConfigError

    for params, problem in [(SamplingParams(presence_penalty=2.5), "presence_penalty"),
                            (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
                            (SamplingParams(temperature=float("inf")), "temperature"),
                            (SamplingParams(logit_bias={3: 101}), "logit_bias"),
                            (SamplingParams(logprobs=21), "logprobs"),
                            (SamplingParams(top_k=-2), "top_k"), (SamplingParams(top_k=1.5), "top_k"),
                            (SamplingParams(min_p=1.5), "min_p"),
                            (SamplingParams(repetition_penalty=0), "repetition_penalty"),
                            (SamplingParams(repetition_penalty=float("inf")), "repetition_penalty")]:
        with pytest.raises(ConfigError, match=problem):
            params.check()


def test_the_repetition_penalty_divides_positive_logits_and_multiplies_negative_ones_seen_anywhere():
    # vLLM's apply_penalties with r = 2: token 0 (prompt, 2.0 > 0) -> 1.0, token 1 (generated, -1.0) -> -2.0;
    # token 2 (0.5) and token 3 (3.0) appear nowhere and stay; token 4 (0.0, in the prompt) stays 0
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    params = SamplingParams(repetition_penalty=2.0)
    assert adjusted(logits, params, [1], prompt=[0, 4, 0]).tolist() == [1.0, -2.0, 0.5, 3.0, 0.0]
    # then OpenAI's penalties on the generated tokens only: token 1 once -> -2.0 - 0.5 - 0.25
    both = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    assert adjusted(logits, both, [1], prompt=[0]).tolist() == [1.0, -2.75, 0.5, 3.0, 0.0]
    assert adjusted(logits, SamplingParams(repetition_penalty=1.0), [1], prompt=[0]) is logits
    # greedy follows the penalised logits: 3.0 -> 1.5 (generated) falls below 2.0 (never seen)
    assert sample(torch.tensor([2.0, 3.0]), SamplingParams(repetition_penalty=2.0), generator(), [1]) == 0
    assert sample(torch.tensor([2.0, 3.0]), SamplingParams(repetition_penalty=2.0), generator(), [], [1]) == 0


def test_min_p_drops_tokens_below_its_share_of_the_largest_probability():
    probabilities = [0.5, 0.3, 0.15, 0.05]
    scores = torch.tensor(probabilities, dtype=torch.float64).log()
    # min_p 0.2: the bar is 0.2 x 0.5 = 0.1, so only the 0.05 token goes; min_p 0.7: 0.35, only 0.5 stays
    kept = truncated(scores, SamplingParams(min_p=0.2, temperature=1.0))
    assert torch.isinf(kept).tolist() == [False, False, False, True]
    assert kept[:3].tolist() == pytest.approx(scores[:3].tolist())
    assert torch.isinf(truncated(scores, SamplingParams(min_p=0.7))).tolist() == [False, True, True, True]
    draws = {sample(scores.float(), SamplingParams(temperature=1.0, min_p=0.2), generator(s), []) for s in range(200)}
    assert draws == {0, 1, 2}
    assert {sample(scores.float(), SamplingParams(temperature=1.0, min_p=0.7), generator(s), [])
            for s in range(50)} == {0}


def test_top_k_keeps_the_k_largest_and_ties_at_the_kth():
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0, -1.0], dtype=torch.float64)
    assert torch.isinf(truncated(scores, SamplingParams(top_k=2))).tolist() == [True, False, False, False, True]
    assert torch.isinf(truncated(scores, SamplingParams(top_k=1))).tolist() == [True, False, True, True, True]
    for disabled in (0, -1, 5, 50):  # 0 and -1 (vLLM's spellings of off) and a k of the whole vocabulary
        assert not torch.isinf(truncated(scores, SamplingParams(top_k=disabled))).any()


def test_top_k_of_one_is_the_greedy_choice_at_any_temperature():
    logits = torch.randn(300, generator=generator(3))
    greedy = int(torch.argmax(logits))
    params = SamplingParams(temperature=2.0, top_k=1)
    assert {sample(logits, params, generator(seed), []) for seed in range(30)} == {greedy}
    assert len({sample(logits, SamplingParams(temperature=2.0), generator(seed), []) for seed in range(30)}) > 1


def test_the_server_takes_vllms_extra_sampling_parameters_and_refuses_unknown_ones():
    pytest.importorskip("pydantic")
    from moe_offload.server.protocol import APIError, ChatRequest, parse

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    request = parse(ChatRequest, {**body, "top_k": 1, "min_p": 0.1, "repetition_penalty": 1.2, "seed": 3})
    assert (request.top_k, request.min_p, request.repetition_penalty, request.seed) == (1, 0.1, 1.2, 3)
    for extra, problem in (({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"),
                           ({"repetition_penalty": 0}, "repetition_penalty"),
                           ({"top_a": 0.5}, "unknown parameter 'top_a'")):
        with pytest.raises(APIError, match=problem) as refused:
            parse(ChatRequest, {**body, **extra})
        assert refused.value.status == 400
