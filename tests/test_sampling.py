"""One request's sampling (runtime/sampling.py) against hand-worked numbers: tiny temperatures are greedy
(no NaN), OpenAI's presence and frequency penalties and logit bias, log-probabilities of the raw logits."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from moe_offload.runtime.requests import SamplingParams  # noqa: E402
from moe_offload.runtime.sampling import adjusted, sample, token_logprobs  # noqa: E402


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
                            (SamplingParams(logprobs=21), "logprobs")]:
        with pytest.raises(ConfigError, match=problem):
            params.check()
