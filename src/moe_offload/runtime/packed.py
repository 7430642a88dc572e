"""A packed forward pass: the tokens of several requests in one sequence, each computed as if it ran alone.

Continuous batching (runtime/batching.py) runs one forward pass per iteration over every running request:
a new request's prompt and every other request's last token, laid end to end in one sequence ``[1, T]``
(the layout of transformers' continuous batching), with each token's own position. A request's tokens form
one *segment* of the sequence. Three things make a segment's result the bits its own pass would give:

- **matrix products per segment**: a product over T rows does not give each row the bits the same product
  gives it over its request's rows alone (measured on this machine's CPU: MKL takes another kernel for one
  row than for several, and another blocking for a row inside a longer block). :func:`segment_rows` makes
  every ``nn.Linear`` and every router of the model run once per segment, and the experts function
  (models/experts.py) computes each expert's products once per segment it serves. Element-wise operations
  and reductions along the hidden dimension (norms, softmax, RoPE, residuals, the experts' activation) do
  not mix rows; they run once over the whole pass.
- **attention per segment** (:func:`segmented_attention`, registered as the attention implementation
  :data:`ATTENTION`): each segment attends over its own request's KV cache (a transformers ``DynamicCache``
  per request, appended to as transformers' own update does) with the arguments transformers' ``sdpa``
  path gives an unpadded single sequence: no mask, causal for a prompt. No padding, so no masked lanes
  change a reduction.
- **the logits of each request's last token**, one row at a time as generate computes them.

What this costs: per iteration, one call of each matrix product per request instead of one for the batch,
and one attention call per request (benchmarks/serve_load.py measures it against ``batch_math="fast"``,
which runs each product once over the whole pass and gives up the bit equality). What it keeps: the experts
a batch needs are the union of its tokens' selections, fetched once; one pass of Python and hooks for the
batch. Outside a packed pass the registered attention is transformers' ``sdpa``, unchanged.

On a GPU the same structure holds, but bit equality also needs kernels that do not change with the number
of rows (cuBLAS picks algorithms by shape) or concurrency: the runtime does not promise it there
(README, "Serving").
"""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION = "moe_offload_segments"


@dataclass
class Segment:
    """One request's tokens in a packed pass: rows ``start:end`` of the sequence."""

    request: int
    start: int
    end: int
    prefill: bool
    cache: object  # the request's transformers DynamicCache


BATCH_MATH = ("exact", "fast")


@dataclass
class PackedPass:
    """``exact``: every product per segment, each request's bits are those it gets alone. Otherwise (the
    engine's ``batch_math="fast"``) products run over the whole pass: fewer, larger matrix products, and
    results that differ from a request's own pass in the last bits (its tokens may differ where two
    logits nearly tie); attention stays per segment (each request has its own cache)."""

    segments: list[Segment]
    exact: bool = True

    @property
    def tokens(self) -> int:
        return self.segments[-1].end

    @property
    def segment_starts(self) -> list[int]:
        return [segment.start for segment in self.segments]

    @property
    def requests(self) -> list[int]:
        return [segment.request for segment in self.segments]


def segmented_attention(module, query, key, value, attention_mask, packed: PackedPass | None = None, **kwargs):
    """transformers' attention interface. In a packed pass: each segment's queries attend over its request's
    cache with the new keys appended; otherwise transformers' sdpa attention."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs = []
    for segment in packed.segments:
        keys, values = segment.cache.update(key[:, :, segment.start:segment.end],
                                            value[:, :, segment.start:segment.end], module.layer_idx)
        output, _ = sdpa_attention_forward(module, query[:, :, segment.start:segment.end], keys, values, None,
                                           **kwargs)
        outputs.append(output)
    return torch.cat(outputs, dim=1), None


def segment_rows(model, adapter, current) -> list:
    """Make every row-wise module of ``model`` compute a packed pass once per segment: every ``nn.Linear``
    (projections, shared experts, the LM head) and every router (a linear, then softmax and top-k per row).
    ``current()`` returns the running PackedPass or None (then the module runs as it is). Returns the
    wrapped modules (:func:`unsegment_rows` undoes it)."""
    import torch

    modules = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    modules += [adapter.router(layer) for layer in range(adapter.num_layers) if adapter.router(layer) not in modules]
    for module in modules:
        module.forward = _per_segment(module.forward, current)
    return modules


def unsegment_rows(modules) -> None:
    for module in modules:
        del module.forward  # the class's own forward again


def _per_segment(forward, current):
    import torch

    def run(rows, *args, **kwargs):
        packed = current()
        if packed is None or not packed.exact or len(packed.segments) == 1 or rows.dim() < 2 \
                or rows.shape[-2] != packed.tokens:
            return forward(rows, *args, **kwargs)
        parts = [forward(rows[..., s.start:s.end, :], *args, **kwargs) for s in packed.segments]
        if isinstance(parts[0], tuple):  # a router: (logits, weights, experts), each [tokens, ...]
            return tuple(torch.cat(column, dim=0) for column in zip(*parts))
        return torch.cat(parts, dim=-2)

    return run


def register_attention(model) -> None:
    """Make :data:`ATTENTION` the model's attention (idempotent); masks are built as for sdpa."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, segmented_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    if model.config._attn_implementation != ATTENTION:
        model.set_attn_implementation(ATTENTION)


def snapshot(cache) -> list[dict]:
    """What a request's cache holds now, to roll back a pass that failed (updates replace tensors)."""
    return [dict(layer.__dict__) for layer in cache.layers]


def restore(cache, saved: list[dict]) -> None:
    for layer, state in zip(cache.layers, saved):
        layer.__dict__.clear()
        layer.__dict__.update(state)
