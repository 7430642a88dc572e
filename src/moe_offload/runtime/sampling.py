"""One request's next token from its own logits: logit bias, presence and frequency penalties, temperature,
top-p, and the log-probabilities a client may ask for.

Everything here reads one request's row of logits and that request's own tokens and generator, so no
request's sampling can reach another's (the batch only shares the forward pass).

**Penalties and bias** (OpenAI's definition): for each token ``j`` generated ``c[j]`` times so far by this
request,

    logit[j] <- logit[j] + bias[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty

With no bias and both penalties 0 the logits are used as they are (the same tensor, the same bits).

**Temperature.** Softmax at temperature ``T`` of the scores ``s`` is ``exp(s_j / T) / sum_k exp(s_k / T)``,
which is unchanged when the largest score ``m`` is subtracted first: ``exp((s_j - m) / T) / sum_k ...``.
Computed that way, in float64, the exponents are ``<= 0`` and the largest is exactly 0, so the sum is at
least 1 whatever ``T``: a tiny temperature (1e-300, which overflows ``s / T`` to infinity and made the
probabilities NaN) sends every other token's exponent to minus infinity, which is the greedy choice in
the limit ``T -> 0``. Temperature 0 itself is greedy: the arg max.

**Top-p**: the smallest set of most likely tokens whose probability reaches ``top_p`` (as transformers'
``TopPLogitsWarper``), then a draw with the request's generator.

**Log-probabilities** are those of the model's distribution, ``log_softmax`` of the raw logits, before the
bias, the penalties and the temperature (vLLM's default, "raw logprobs"): the chosen token's and the
``top`` most likely tokens'.
"""

from __future__ import annotations

from collections import Counter


def adjusted(logits, params, generated: list[int]):
    """The logits after ``params.logit_bias`` and the penalties for the tokens ``generated`` so far."""
    if not params.logit_bias and not params.presence_penalty and not params.frequency_penalty:
        return logits
    import torch

    scores = logits.clone()
    for token, bias in params.logit_bias.items():
        scores[token] += bias
    if generated and (params.presence_penalty or params.frequency_penalty):
        counts = Counter(generated)
        tokens = torch.tensor(list(counts), dtype=torch.long, device=scores.device)
        times = torch.tensor(list(counts.values()), dtype=scores.dtype, device=scores.device)
        scores[tokens] -= times * params.frequency_penalty + params.presence_penalty
    return scores


def sample(logits, params, generator, generated: list[int]) -> int:
    """The next token from one request's logits [vocab] (float32), given the tokens it generated so far."""
    import torch

    scores = adjusted(logits, params, generated)
    if params.temperature == 0:
        return int(torch.argmax(scores))
    scores = scores.cpu().double()
    scores = (scores - scores.max()) / params.temperature
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - params.top_p)
        remove[-1] = False  # keep at least the most likely token
        scores[order[remove]] = -float("inf")
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
