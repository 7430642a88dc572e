"""A packed forward pass: the tokens of several requests in one sequence, each computed as if it ran alone.

Continuous batching (runtime/batching.py) runs one forward pass per iteration over every running request:
a new request's prompt and every other request's last token, laid end to end in one sequence ``[1, T]``
(the layout of transformers' continuous batching), with each token's own position. A request's tokens form
one *segment* of the sequence. Three things make a segment's result the bits its own pass would give:

- **matrix products per segment**: a product over T rows does not give each row the bits the same product
  gives it over its request's rows alone (measured on this machine's CPU: MKL takes another kernel for one
  row than for several, and another blocking for a row inside a longer block). :meth:`PackedPass.linear`
  makes every ``nn.Linear`` and every router of the model (:func:`segment_rows`) compute each segment's rows
  as that segment alone, and the experts function (models/experts.py) computes each expert's products per
  segment it serves. The rows that are alone in their product (a decoding request's one token; an expert
  that serves one token of a segment) all go into **one** ``torch.bmm`` against the weight broadcast over
  them (:func:`alone_rows`): on CPU, PyTorch computes a float32 ``bmm`` whose operands are plain or
  transposed matrices with one BLAS ``gemm`` call per batch entry, the very call ``F.linear`` makes for one
  row, so each row gets the bits of its own product (checked on this machine for every product shape of the
  bundled model and of 2048-wide ones, 1 to 69 rows, 1 and 2 threads: ``tests/test_batching_rows.py``). Where
  that does not hold (another device or dtype, a bias, a weight that is not one contiguous matrix, or a
  product under 400 multiply-adds, which PyTorch's ``bmm`` computes with a loop of its own) the rows take
  one product each. Segments of several rows (prompts) take one product each. Element-wise operations
  and reductions along the hidden dimension (norms, softmax, top-k, RoPE, residuals, the experts'
  activation) do not mix rows; they run once over the whole pass.
- **attention per segment** (:func:`segmented_attention`, registered as the attention implementation
  :data:`ATTENTION`): each segment attends over its own request's keys and values (its slot of the
  scheduler's KV pool, runtime/kv_pool.py, the pass's new keys written in first) with the arguments
  transformers' ``sdpa`` path gives an unpadded single sequence: no mask, causal for a prompt. No padding,
  so no masked lanes change a reduction. (With fast batch math the decoding requests attend in one masked
  call instead.)
- **the logits of each request's last token**, one row at a time as generate computes them.

What this costs: each decoding request's products read the weights once for that request (a ``bmm`` of
one-row products is as many matrix-vector products), where ``batch_math="fast"`` runs each product once
over the whole pass (one read of the weights, one matrix-matrix product) and one attention call for the
decoding requests, and gives up the bit equality; each prompt's products and each request's attention are
calls of their own (benchmarks/serve_load.py measures both modes). What it keeps: the experts a batch needs
are the union of its tokens' selections, fetched once; one pass of Python and hooks for the batch. Outside
a packed pass the registered attention is transformers' ``sdpa``, unchanged.

On a GPU the same structure holds, but bit equality also needs kernels that do not change with the number
of rows (cuBLAS picks algorithms by shape) or concurrency: the runtime does not promise it there
(README, "Serving").
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property

from moe_offload.models.experts import linear
from moe_offload.runtime.kv_pool import KVPool

ATTENTION = "moe_offload_segments"


@dataclass
class Segment:
    """One request's tokens in a packed pass: rows ``start:end`` of the sequence, at positions ``past`` onward
    of the request's ``slot`` in the pass's KVPool (``past``: the positions it already holds)."""

    request: int
    start: int
    end: int
    prefill: bool
    slot: int
    past: int



@dataclass
class PackedPass:
    """``exact``: every product per segment, each request's bits are those it gets alone. Otherwise (the
    engine's ``batch_math="fast"``) products run over the whole pass: fewer, larger matrix products, and
    results that differ from a request's own pass in the last bits (its tokens may differ where two
    logits nearly tie), and the decoding requests' attention is one masked call over their KV slots."""

    segments: list[Segment]
    kv: KVPool
    exact: bool = True
    device: str = "cpu"

    @property
    def tokens(self) -> int:
        return self.segments[-1].end

    @property
    def segment_starts(self) -> list[int]:
        return [segment.start for segment in self.segments]

    @property
    def requests(self) -> list[int]:
        return [segment.request for segment in self.segments]

    @cached_property
    def one_row(self) -> list[Segment]:
        """The segments of one row (a decoding request's token)."""
        return [s for s in self.segments if s.end - s.start == 1]

    @cached_property
    def decoding(self):
        """The one-row segments' (rows, slots, positions): index tensors on the pass's device."""
        import torch

        return tuple(torch.tensor(values, dtype=torch.long, device=self.device) for values in
                     ([s.start for s in self.one_row], [s.slot for s in self.one_row], [s.past for s in self.one_row]))

    @cached_property
    def decoding_mask(self):
        """Fast batch math's one attention call for the one-row segments, over their slots' first ``held``
        positions (the longest one's, its new token included): ``(span, mask)``. Where the decoding slots are
        at least half of the pool's first ``span = max slot + 1`` (slots are handed out lowest first, so
        usually), the call runs over those slots as they lie in the pool, no copy: ``mask`` [span, 1, 1, held]
        is True at each decoding slot's positions and at position 0 of the other slots (rows computed and
        dropped; one position, so that no row is all masked). Otherwise ``span`` is None and the call runs
        over a gathered copy of the decoding slots: ``mask`` [n, 1, 1, held]."""
        import torch

        _, slots, positions = self.decoding
        held = max(s.past for s in self.one_row) + 1  # from the host: no device sync
        span = max(s.slot for s in self.one_row) + 1
        if span > 2 * len(self.one_row):
            return None, (torch.arange(held, device=self.device) <= positions[:, None])[:, None, None, :]
        last = torch.zeros(span, dtype=torch.long, device=self.device)
        last[slots] = positions
        return span, (torch.arange(held, device=self.device) <= last[:, None])[:, None, None, :]

    @cached_property
    def longer(self) -> list[Segment]:
        """The segments of more than one row (prompts)."""
        return [s for s in self.segments if s.end - s.start > 1]

    def linear(self, rows, weight, bias=None):
        """``F.linear`` over the pass's rows (``rows`` [..., T, in], leading dimensions of size 1): with exact
        batch math each segment's rows get the bits ``F.linear`` gives that segment alone, the one-row
        segments all in one :func:`alone_rows` product where it gives those bits."""
        import torch
        import torch.nn.functional as F

        if not self.exact or len(self.segments) == 1:
            return F.linear(rows, weight, bias)
        if len(self.one_row) < 2 or not batches_alone(rows, weight, bias):
            return torch.cat([F.linear(rows[..., s.start:s.end, :], weight, bias) for s in self.segments], dim=-2)
        flat = rows.reshape(-1, rows.shape[-1])
        if not self.longer:
            return alone_rows(flat, weight, bias).reshape(*rows.shape[:-1], weight.shape[0])
        alone = self.decoding[0]  # on the CPU, as batches_alone requires
        out = flat.new_empty(self.tokens, weight.shape[0])
        out[alone] = alone_rows(flat[alone], weight, bias)
        for s in self.longer:
            out[s.start:s.end] = F.linear(rows[..., s.start:s.end, :], weight, bias).reshape(-1, weight.shape[0])
        return out.reshape(*rows.shape[:-1], weight.shape[0])


    def blocks(self, rows, sizes: list[int], weight):
        """The experts' products (models/experts.py): ``F.linear(rows, weight)`` over consecutive blocks of
        ``rows``, ``sizes[i]`` rows each, each block with the bits it has alone; the one-row blocks first (the
        caller orders them so), in one :func:`alone_rows` product where that keeps their bits."""
        import torch

        ones = sizes.count(1)
        if ones < 2 or not isinstance(weight, torch.Tensor) or not batches_alone(rows, weight):
            ones = 0  # a product per block (the int4 kernel's weight too: runtime/int4_kernel.py)
        parts = [alone_rows(rows[:ones], weight)] if ones else []
        first = ones
        for size in sizes[ones:]:
            parts.append(linear(rows[first:first + size], weight))
            first += size
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def last_logits(self, hidden, head):
        """The logits [segments, vocab] of each segment's last row of ``hidden`` [1, T, H] under ``head`` (the
        LM head): with exact batch math each row as generate computes it alone (a one-row product), else one
        product over the rows."""
        import torch

        last = hidden[0, [s.end - 1 for s in self.segments]]
        if not self.exact:
            return head(last)
        if batches_alone(last, head.weight, head.bias):
            return alone_rows(last, head.weight, head.bias)
        return torch.cat([head(last[i:i + 1][None])[0] for i in range(len(last))])


def batches_alone(rows, weight, bias=None) -> bool:
    """Whether :func:`alone_rows` gives each row of ``rows`` the bits of ``F.linear`` over that row alone: on
    CPU with MKL, float32 at the highest matmul precision, a weight that is one contiguous [out, in] matrix
    and at least 400 multiply-adds per row (below that PyTorch's ``bmm`` runs a loop of its own, which sums
    in another order)."""
    import torch

    return (rows.device.type == "cpu" and rows.dtype == weight.dtype == torch.float32 and weight.dim() == 2
            and weight.is_contiguous() and weight.shape[0] * weight.shape[1] >= 400
            and (bias is None or (bias.dtype == torch.float32 and bias.dim() == 1))
            and torch.backends.mkl.is_available() and torch.get_float32_matmul_precision() == "highest")


def alone_rows(rows, weight, bias=None):
    """``rows`` [R, in] times ``weight`` [out, in] transposed (plus ``bias``), as R one-row products in one
    ``bmm``: PyTorch runs one BLAS ``gemm`` per batch entry with the operands ``F.linear`` passes for one row
    (the weight broadcast, transposed, never copied), so under :func:`batches_alone` each row has the bits of
    its own ``F.linear``."""
    import torch

    columns = weight.t().expand(rows.shape[0], -1, -1)
    if bias is None:
        return torch.bmm(rows.unsqueeze(1), columns).squeeze(1)
    return torch.baddbmm(bias.expand(rows.shape[0], 1, -1), rows.unsqueeze(1), columns).squeeze(1)


def segmented_attention(module, query, key, value, attention_mask, packed: PackedPass | None = None, **kwargs):
    """transformers' attention interface. In a packed pass: the pass's new keys and values are written into
    each request's slot of the KV pool, then each segment's queries attend over its slot's positions (the
    held ones and the new ones) with transformers' sdpa attention, as an unpadded single sequence: no mask,
    causal for a prompt. With fast batch math the decoding requests' queries (one row each) attend in one
    call over their slots, padded to the longest and masked. Otherwise transformers' sdpa attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    keys, values = packed.kv.layer(module.layer_idx, key)
    rows, slots, positions = packed.decoding
    if len(rows):  # one indexed store for every decoding request's new key and value
        keys[slots, :, positions] = key[0][:, rows].transpose(0, 1)
        values[slots, :, positions] = value[0][:, rows].transpose(0, 1)
    for segment in packed.longer:
        end = segment.past + segment.end - segment.start
        keys[segment.slot, :, segment.past:end] = key[0, :, segment.start:segment.end]
        values[segment.slot, :, segment.past:end] = value[0, :, segment.start:segment.end]
    output = query.new_empty(1, packed.tokens, query.shape[1], value.shape[3])
    together = not packed.exact and len(rows) > 1
    if together:  # [n or span, heads, 1, dim] queries over [n or span, kv_heads, held, dim] slots
        span, mask = packed.decoding_mask
        held = mask.shape[-1]
        queries = query[0][:, rows].transpose(0, 1).unsqueeze(2)
        if span is None:
            output[0, rows] = sdpa_attention_forward(module, queries, keys[slots, :, :held], values[slots, :, :held],
                                                     mask, **kwargs)[0][:, 0]
        else:
            in_place = queries.new_zeros(span, *queries.shape[1:])
            in_place[slots] = queries
            output[0, rows] = sdpa_attention_forward(module, in_place, keys[:span, :, :held], values[:span, :, :held],
                                                     mask, **kwargs)[0][slots, 0]
    for segment in packed.longer if together else packed.segments:
        end = segment.past + segment.end - segment.start
        output[:, segment.start:segment.end] = sdpa_attention_forward(
            module, query[:, :, segment.start:segment.end], keys[segment.slot:segment.slot + 1, :, :end],
            values[segment.slot:segment.slot + 1, :, :end], None, **kwargs)[0]
    return output, None


def segment_rows(model, adapter, current) -> list:
    """Make every row-wise module of ``model`` compute a packed pass as :meth:`PackedPass.linear` does: every
    ``nn.Linear`` (projections, shared experts, the LM head) and every router (its linear; the softmax and
    top-k after it are per row and run over the whole pass). ``current()`` returns the running PackedPass or
    None (then the module runs as it is). Returns the wrapped modules (:func:`unsegment_rows` undoes it)."""
    import torch

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    routers = [adapter.router(layer) for layer in range(adapter.num_layers) if adapter.router(layer) not in linears]
    for module in linears:
        module.forward = _linear_per_segment(module, current)
    for module in routers:
        module.forward = _router_per_segment(module.forward, current)
    return linears + routers


def unsegment_rows(modules) -> None:
    for module in modules:
        del module.forward  # the class's own forward again


def _in_pass(packed, rows) -> bool:
    return packed is not None and packed.exact and len(packed.segments) > 1 and rows.dim() >= 2 \
        and rows.shape[-2] == packed.tokens


def _linear_per_segment(module, current):
    forward = module.forward

    def run(rows):
        packed = current()
        if not _in_pass(packed, rows):
            return forward(rows)
        return packed.linear(rows, module.weight, module.bias)

    return run


def _router_per_segment(forward, current):
    """A router (a linear, then per-row softmax and top-k: transformers' routers are functions of their own,
    not ``nn.Linear``): its forward over the whole pass, with its ``F.linear`` calls over the pass's rows
    computed by :meth:`PackedPass.linear`."""
    def run(rows, *args, **kwargs):
        packed = current()
        if not _in_pass(packed, rows):
            return forward(rows, *args, **kwargs)
        with _packed_linear_mode()(packed):
            return forward(rows, *args, **kwargs)

    return run


@cache  # one class, made on first use: PyTorch is imported lazily
def _packed_linear_mode():
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class PackedLinear(TorchFunctionMode):
        """Inside: ``F.linear`` over a packed pass's T rows runs as :meth:`PackedPass.linear` (the mode is off
        while it handles a call, so the products it runs are plain)."""

        def __init__(self, packed):
            super().__init__()
            self.packed = packed

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.linear and isinstance(args[0], torch.Tensor) and _in_pass(self.packed, args[0]):
                return self.packed.linear(*args, **kwargs)
            return func(*args, **kwargs)

    return PackedLinear


def register_attention(model) -> None:
    """Make :data:`ATTENTION` the model's attention (idempotent); masks are built as for sdpa."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, segmented_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    if model.config._attn_implementation != ATTENTION:
        model.set_attn_implementation(ATTENTION)
