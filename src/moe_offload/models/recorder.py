"""Record routing traces from a real model: `moe-offload record`.

Greedy generation with transformers' own ``generate``, a batch of prompts at a time (left-padded), with a
:class:`~moe_offload.models.routing_tap.RoutingTap` on every router. Each forward pass is one iteration:
the batch's prefill, then one per decode step. For every real token (never a pad, never a token after its
request's end-of-text) the trace gets a row with

- ``experts`` and ``weights``: the router's selection, in rank order (largest weight first);
- ``probs``: the router's full distribution over the layer's experts (fMoE's expert map; a sigmoid router's
  scores are normalised to sum to 1);
- ``gate_prediction``: router l+1 applied to layer l's post-attention hidden state through layer l+1's own
  norm (MoEpic's speculative gate), for l = 0..L-2;
- ``next_token_gate_prediction``: router 0, through layer 0's norm, applied to the last layer's
  post-attention hidden state (MoEpic's prediction of layer 0 of the request's next token, after AdapMoE);
- ``embedding``: the token's input embedding, the output of the model's own embedding layer for the token
  that row feeds the model (fMoE pools each iteration's semantic embedding from these, prefetch/fmoe.py).

The first decode step processes the first generated token, so a request that generates G tokens has
G - 1 decode rows (its last token is never fed back), or fewer when it ends with end-of-text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.models.routing_tap import LayerRouting, RoutingTap
from moe_offload.text.prompts import Prompt
from moe_offload.trace.format import DECODE, PREFILL, Trace, TraceMeta
from moe_offload.values import context_room, generation_length, integer


@dataclass
class Recording:
    trace: Trace
    generated: list[list[int]] = field(default_factory=list)  # per prompt: generated token ids (up to end-of-text)
    texts: list[str] = field(default_factory=list)


class _ForwardCapture:
    """Per forward pass and MoE layer: selections, weights, full probabilities, next-layer prediction."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.forwards: list[list[dict]] = []

    def __call__(self, layer: int, routing: LayerRouting) -> None:
        import torch

        if layer == 0:
            self.forwards.append([])
        layers = self.forwards[-1]
        if len(layers) != layer:
            raise RuntimeError(f"router of MoE layer {layer} ran out of order")
        weights, order = routing.weights.float().sort(dim=-1, descending=True, stable=True)
        captured = {
            "experts": torch.gather(routing.experts, -1, order).cpu().numpy(),
            "weights": weights.cpu().numpy(),
            "probs": self.adapter.probabilities(routing.logits).cpu().numpy(),
        }
        predicted = self.adapter.probabilities(self.adapter.predict_next_router_logits(layer, routing.hidden))
        last = layer + 1 == self.adapter.num_layers  # the last layer predicts layer 0 of the next token
        captured["next_token_gate_prediction" if last else "gate_prediction"] = predicted.cpu().numpy()
        layers.append(captured)


PER_LAYER = ("experts", "weights", "probs", "gate_prediction")


def _stack(layers: list[dict], key: str, rows) -> np.ndarray:
    """[rows, layers, ...] from per-layer captures (gate_prediction exists for all layers but the last)."""
    return np.stack([layer[key][rows] for layer in layers if key in layer], axis=1)


def _columns_of(layers: list[dict], rows) -> dict[str, np.ndarray]:
    """The routing columns of ``rows`` of one forward pass."""
    columns = {key: _stack(layers, key, rows) for key in PER_LAYER}
    columns["next_token_gate_prediction"] = layers[-1]["next_token_gate_prediction"][rows]
    return columns


def record(model, adapter, tokenizer, prompts: list[Prompt], *, model_name: str, max_new_tokens: int = 64,
           batch_size: int = 8, prompt_source: str = "", on_batch: Callable[[int], None] | None = None,
           tap: bool = True) -> Recording:
    """Generate greedily for every prompt and return the trace and the generated tokens.

    ``tap=False`` generates the same way without any hook (the test that recording changes nothing)."""
    import torch

    max_new_tokens = integer(max_new_tokens, "--max-new-tokens", low=1)
    batch_size = integer(batch_size, "--batch-size", low=1)
    positions = getattr(model.config, "max_position_embeddings", None)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos = tokenizer.eos_token_id
    columns: dict[str, list] = {name: [] for name in ("request", "position", "phase", "iteration", "experts",
                                                      "weights", "probs", "gate_prediction",
                                                      "next_token_gate_prediction", "embedding")}
    generated_ids: list[list[int]] = []
    requests_meta = []
    iteration = 0
    embed = model.get_input_embeddings()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        encoded = tokenizer([p.text for p in batch], return_tensors="pt", padding=True, padding_side="left",
                            add_special_tokens=True)
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        if (mask.sum(dim=1) == 0).any():
            empty = batch[int((mask.sum(dim=1) == 0).nonzero()[0])]
            raise ConfigError(f"prompt {empty.source} is empty after tokenization")
        if positions:  # the model's context: the longest prompt and the tokens after it must fit
            longest = int(mask.sum(dim=1).argmax())
            context_room(int(mask[longest].sum()), positions, f"prompt {batch[longest].source}")
            generation_length(max_new_tokens, int(mask[longest].sum()), positions)
        capture = _ForwardCapture(adapter)
        with torch.no_grad():
            if tap:
                with RoutingTap(adapter, capture, capture_hidden=True):
                    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                         do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
            else:
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
            embeddings = embed(out).float().numpy()  # [B, padded + generated, H], each token's input embedding
        padded = ids.shape[1]
        new = out[:, padded:].tolist()
        lengths = mask.sum(dim=1).tolist()
        for b, tokens in enumerate(new):
            ended = tokens.index(eos) + 1 if eos is not None and eos in tokens else len(tokens)
            generated_ids.append(tokens[:ended])
        if not tap:
            continue
        steps = len(new[0])
        if len(capture.forwards) != steps:
            raise RuntimeError(f"expected {steps} forward passes for {steps} generated tokens, saw "
                               f"{len(capture.forwards)}")
        # prefill: row b * padded + p of the flattened [B, padded] batch, real tokens only (left padding)
        prefill = capture.forwards[0]
        for b, n in enumerate(lengths):
            rows = np.arange(b * padded + padded - n, (b + 1) * padded)
            request = start + b
            columns["request"].append(np.full(n, request))
            columns["position"].append(np.arange(n))
            columns["phase"].append(np.full(n, PREFILL))
            columns["iteration"].append(np.full(n, iteration))
            for key, values in _columns_of(prefill, rows).items():
                columns[key].append(values)
            columns["embedding"].append(embeddings[b, padded - n:padded])
            requests_meta.append({"request": request, "source": batch[b].source, "prompt_tokens": n,
                                  "generated_tokens": len(generated_ids[request])})
        # decode step s processes generated token s-1 of every request still running
        for step in range(1, steps):
            layers = capture.forwards[step]
            for b, n in enumerate(lengths):
                request = start + b
                if step >= len(generated_ids[request]):
                    continue  # ended with end-of-text: the server would have dropped it from the batch
                columns["request"].append(np.array([request]))
                columns["position"].append(np.array([n + step - 1]))
                columns["phase"].append(np.array([DECODE]))
                columns["iteration"].append(np.array([iteration + step]))
                for key, values in _columns_of(layers, [b]).items():
                    columns[key].append(values)
                columns["embedding"].append(embeddings[b, padded + step - 1][None])
        iteration += steps
        if on_batch:
            on_batch(len(batch))

    texts = [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in generated_ids]
    if not tap:
        return Recording(trace=None, generated=generated_ids, texts=texts)
    data = {key: np.concatenate(values) for key, values in columns.items()}
    order = np.lexsort((data["position"], data["request"], data["iteration"]))
    data = {key: values[order] for key, values in data.items()}
    description = adapter.describe()
    meta = TraceMeta(
        model=model_name, num_layers=adapter.num_layers, num_experts=adapter.num_experts, top_k=adapter.top_k,
        expert_bytes=adapter.stored_expert_bytes(), hidden_size=adapter.hidden_size,
        source=f"moe-offload record: {model_name}, prompts {prompt_source or 'given'}, greedy, "
               f"max_new_tokens={max_new_tokens}, batch_size={batch_size}",
        extra={"recorder": {"prompts": prompt_source, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
                            "requests": requests_meta},
               "router_scoring": description["router_scoring"], "top_k_normalised": description["top_k_normalised"],
               "decoder_layers": description["decoder_layers"], "model_config": description["config"],
               "gate_prediction": "router l+1 (through its own norm) on layer l's post-attention hidden state",
               "next_token_gate_prediction": "router 0 (through its own norm) on the last layer's post-attention "
                                             "hidden state"})
    trace = Trace.build(meta, data["experts"], request=data["request"], position=data["position"],
                        phase=data["phase"], iteration=data["iteration"], weights=data["weights"],
                        probs=data["probs"], embedding=data["embedding"], gate_prediction=data["gate_prediction"],
                        next_token_gate_prediction=data["next_token_gate_prediction"])
    return Recording(trace=trace, generated=generated_ids, texts=texts)
