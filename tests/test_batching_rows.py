"""Exact batch math's one-row products (runtime/packed.py): the rows that are alone in their product (decoding
requests' tokens) computed in one ``bmm`` get, bit for bit, what ``F.linear`` gives each row alone (the engine's
path for a request alone), for every product shape of the bundled model and every batch size served (1 to
64); a packed pass mixing prompts and decoding tokens gives every segment the bits of its own product; where
the ``bmm`` would not keep the bits, it is not used."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402

from moe_offload.runtime.kv_pool import KVPool  # noqa: E402
from moe_offload.runtime.packed import PackedPass, Segment, alone_rows, batches_alone  # noqa: E402


def alone(rows, weight, bias=None):
    """Each row as the engine computes it for a request alone: ``F.linear`` on a [1, 1, in] input."""
    return torch.cat([F.linear(rows[i:i + 1][None], weight, bias)[0] for i in range(rows.shape[0])])


@pytest.fixture(scope="module")
def model_weights():
    """A product weight of the bundled model per shape: projections, LM head, routers, experts' gate_up and down."""
    from moe_offload.models.tiny import load

    model, _, _ = load("tiny", dtype=torch.float32)
    weights = {name: p.detach() for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name}
    weights["lm_head"] = model.lm_head.weight.detach()  # tied to the embeddings
    experts = model.model.layers[0].mlp.experts
    weights["gate_up_proj[0]"] = experts.gate_up_proj[0].detach()
    weights["down_proj[0]"] = experts.down_proj[0].detach()
    return {tuple(w.shape): w for w in weights.values()}


def test_one_bmm_gives_each_row_its_own_products_bits_for_every_shape_and_batch_size(model_weights):
    assert {(192, 192), (64, 192), (8, 192), (768, 192), (192, 384), (4096, 192)} <= set(model_weights)
    generator = torch.Generator().manual_seed(0)
    for name, weight in model_weights.items():
        weight = weight.float().contiguous()
        for rows in range(1, 65):
            x = torch.randn(rows, weight.shape[1], generator=generator)
            assert batches_alone(x, weight), name
            assert torch.equal(alone_rows(x, weight), alone(x, weight)), (name, rows)


def test_with_a_bias_and_on_rows_that_are_a_view():
    generator = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(64, 96, generator=generator), torch.randn(64, generator=generator)
    for rows in (2, 5, 16, 33):
        x = torch.randn(2 * rows, 96, generator=generator)[::2]  # every other row of a larger tensor
        assert torch.equal(alone_rows(x, weight, bias), alone(x.contiguous(), weight, bias))


def test_not_used_where_it_would_not_keep_the_bits():
    x = torch.randn(4, 10)
    assert not batches_alone(x, torch.randn(30, 10))      # 300 multiply-adds a row: bmm's own loop
    assert batches_alone(x, torch.randn(40, 10))          # 400: one gemm per row
    assert not batches_alone(x, torch.randn(10, 40).t())  # a transposed weight: another gemm layout
    assert not batches_alone(x.double(), torch.randn(40, 10).double())
    assert not batches_alone(x.half(), torch.randn(40, 10).half())


def packed(lengths: list[int], exact: bool = True) -> PackedPass:
    segments, start = [], 0
    for request, length in enumerate(lengths):
        segments.append(Segment(request, start, start + length, length > 1, request, 0))
        start += length
    return PackedPass(segments, KVPool(len(lengths)), exact)


@pytest.mark.parametrize("lengths", [[1] * 16, [1, 7, 1, 1, 3, 1], [5, 1], [1, 1], [9], [4, 6]])
def test_a_packed_pass_gives_each_segment_its_own_products_bits(lengths):
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(768, 192, generator=generator)
    rows = torch.randn(1, sum(lengths), 192, generator=generator)
    pass_ = packed(lengths)
    got = pass_.linear(rows, weight)
    for s in pass_.segments:
        assert torch.equal(got[:, s.start:s.end], F.linear(rows[:, s.start:s.end], weight))
    # the experts' blocks (one-row blocks first, as the experts function orders them)
    sizes = sorted(lengths, key=lambda n: n > 1)
    blocks = pass_.blocks(rows[0], sizes, weight)
    first = 0
    for size in sizes:
        assert torch.equal(blocks[first:first + size], F.linear(rows[0, first:first + size], weight))
        first += size
    # the LM head on each segment's last row, as generate computes it
    head = torch.nn.Linear(192, 4096, bias=False)
    logits = pass_.last_logits(rows, head)
    for i, s in enumerate(pass_.segments):
        assert torch.equal(logits[i], head(rows[:, s.end - 1:s.end])[0, -1])
