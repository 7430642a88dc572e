"""One request's next token from its own logits: logit bias, the repetition, presence and frequency penalties,
temperature, min-p, top-k, top-p, and the log-probabilities a client may ask for.

Everything here reads one request's row of logits and that request's own tokens and generator, so no
request's sampling can reach another's (the batch only shares the forward pass).

The steps and their order are vLLM's sampler's (vllm-project/vllm, ``vllm/v1/sample/sampler.py``): the
logit bias, then the penalties (``vllm/model_executor/layers/utils.py`` ``apply_penalties``), then greedy
when the temperature is 0, else the temperature, min-p (``vllm/v1/sample/logits_processor``), top-k and
top-p (``vllm/v1/sample/ops/topk_topp_sampler.py``) and a draw.

**Repetition penalty** (vLLM's and SGLang's, from CTRL, Keskar et al. 2019): for each token ``j`` that appears
in the prompt or in the tokens generated so far, with penalty ``r > 0``,

    logit[j] <- logit[j] / r   if logit[j] > 0,   logit[j] * r   otherwise

so ``r > 1`` makes every token already seen less likely and ``r = 1`` changes nothing.

**Presence and frequency penalties and bias** (OpenAI's definition): for each token ``j`` generated ``c[j]``
times so far by this request (the prompt does not count),

    logit[j] <- logit[j] + bias[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty

With no bias, all penalties neutral, the logits are used as they are (the same tensor, the same bits).

**Temperature.** Softmax at temperature ``T`` of the scores ``s`` is ``exp(s_j / T) / sum_k exp(s_k / T)``,
which is unchanged when the largest score ``m`` is subtracted first: ``exp((s_j - m) / T) / sum_k ...``.
Computed that way, in float64, the exponents are ``<= 0`` and the largest is exactly 0, so the sum is at
least 1 whatever ``T``: a tiny temperature (1e-300, which overflows ``s / T`` to infinity and made the
probabilities NaN) sends every other token's exponent to minus infinity, which is the greedy choice in
the limit ``T -> 0``. Temperature 0 itself is greedy: the arg max (after the bias and the penalties, which
can change it; min-p, top-k and top-p never remove the most likely token, so they cannot).

**Min-p** (``min_p`` in [0, 1], 0 disables): a token whose probability at temperature ``T`` is below
``min_p`` times the largest probability is dropped.

**Top-k** (``top_k``; 0 or -1 disables, as in vLLM): the tokens whose score is below the ``k``-th largest are
dropped (a tie at the ``k``-th score keeps every tied token, as vLLM's mask does); ``k`` past the vocabulary
keeps all.

**Top-p**: of what is left, the smallest set of most likely tokens whose probability reaches ``top_p`` (as
transformers' ``TopPLogitsWarper``), then a draw with the request's generator.

**Log-probabilities** are those of the model's distribution, ``log_softmax`` of the raw logits, before the
bias, the penalties and the temperature (vLLM's default, "raw logprobs"): the chosen token's and the
``top`` most likely tokens'.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence


def adjusted(logits, params, generated: list[int], prompt: Sequence[int] = ()):
    """The logits after ``params.logit_bias``, the repetition penalty for the tokens of ``prompt`` and
    ``generated``, and the presence and frequency penalties for the tokens ``generated`` so far."""
    repetition = params.repetition_penalty != 1.0 and (generated or len(prompt))
    if not params.logit_bias and not params.presence_penalty and not params.frequency_penalty and not repetition:
        return logits
    import torch

    scores = logits.clone()
    for token, bias in params.logit_bias.items():
        scores[token] += bias
    if repetition:
        seen = torch.tensor(sorted(set(prompt) | set(generated)), dtype=torch.long, device=scores.device)
        values = scores[seen]
        scores[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    if generated and (params.presence_penalty or params.frequency_penalty):
        counts = Counter(generated)
        tokens = torch.tensor(list(counts), dtype=torch.long, device=scores.device)
        times = torch.tensor(list(counts.values()), dtype=scores.dtype, device=scores.device)
        scores[tokens] -= times * params.frequency_penalty + params.presence_penalty
    return scores


def truncated(scores, params):
    """The scores (float64, largest 0, divided by the temperature) with the tokens min-p, top-k and top-p drop
    set to minus infinity; the most likely token is always kept."""
    import torch

    if params.min_p > 0:
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), -float("inf"))
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - params.top_p)
        remove[-1] = False  # keep at least the most likely token
        scores = scores.clone()
        scores[order[remove]] = -float("inf")
    return scores


def sample(logits, params, generator, generated: list[int], prompt: Sequence[int] = ()) -> int:
    """The next token from one request's logits [vocab] (float32), given its prompt's tokens and the tokens it
    generated so far."""
    import torch

    scores = adjusted(logits, params, generated, prompt)
    if params.temperature == 0:
        return int(torch.argmax(scores))
    scores = scores.cpu().double()
    scores = truncated((scores - scores.max()) / params.temperature, params)
    probs = scores.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """``token``'s log-probability under the model's distribution, and the ``top`` most likely tokens with
    theirs, most likely first."""
    import torch

    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = []
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        best = [(int(i), float(v)) for i, v in zip(ids, values)]
    return float(logprobs[token]), best
