"""Group-wise expert quantization (runtime/quantize.py) against hand-worked bytes and its error bound."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from moe_offload.runtime.quantize import dequantize, group_size, quantize, quantized_nbytes  # noqa: E402


def test_int4_bytes_by_hand():
    # one group of 4 (K = 4): max |w| = 7 -> s = 1; q = w; stored q + 8 = [15, 1, 9, 8], low nibble first
    stored = quantize(torch.tensor([[7.0, -7.0, 1.0, 0.0]]), "int4")
    assert stored.tolist() == [15 | 1 << 4, 9 | 8 << 4, 0x00, 0x3C]  # then s = 1.0 in float16: 0x3C00
    assert dequantize(stored, (1, 4), "int4", torch.float32).tolist() == [[7.0, -7.0, 1.0, 0.0]]


def test_int8_bytes_by_hand():
    # max |w| = 2.54 -> s = 0.02 (float16 0.02 = 0.0200042724609375); q = round(w / s)
    stored = quantize(torch.tensor([[2.54, -1.0, 0.01, 0.0]]), "int8")
    scale = torch.tensor(0.02, dtype=torch.float16).item()
    assert stored[:4].view(torch.int8).tolist() == [round(2.54 / scale), round(-1.0 / scale), round(0.01 / scale), 0]
    assert stored[4:].view(torch.float16).item() == scale


@pytest.mark.parametrize("expert_dtype, limit", [("int8", 127), ("int4", 7)])
def test_the_error_is_at_most_half_a_step_of_each_group(expert_dtype, limit):
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(0)).half()
    stored = quantize(weight, expert_dtype)
    assert stored.numel() == quantized_nbytes(weight.shape, expert_dtype)
    back = dequantize(stored, weight.shape, expert_dtype, torch.float32)
    groups = weight.float().reshape(48, 96 // group_size(96), -1)
    step = (groups.abs().amax(-1, keepdim=True) / limit).half().float()
    error = (back.reshape(groups.shape) - groups).abs()
    assert bool((error <= step / 2 + 1e-6).all())


def test_the_tiny_model_s_expert_sizes():
    # gate_up_proj [768, 192] and down_proj [192, 384], groups of 64: values, then float16 scales
    float16 = (768 * 192 + 192 * 384) * 2
    int8 = 768 * 192 + 768 * 3 * 2 + 192 * 384 + 192 * 6 * 2
    int4 = 768 * 192 // 2 + 768 * 3 * 2 + 192 * 384 // 2 + 192 * 6 * 2
    assert quantized_nbytes((768, 192), "int8") + quantized_nbytes((192, 384), "int8") == int8 == 228096
    assert quantized_nbytes((768, 192), "int4") + quantized_nbytes((192, 384), "int4") == int4 == 117504
    assert int4 / float16 < 0.27 and float16 / int4 > 3.7
