"""Group-wise weight-only quantization of the packed experts (``pack --expert-dtype int8|int4``).

A weight ``W`` of shape ``[N, K]`` (output rows, input columns) is cut along ``K`` into groups of ``G``
consecutive columns. Each group ``g`` of row ``n`` gets one scale, symmetric around zero:

    s[n, g] = max_k |W[n, gG + k]| / Q        (Q = 127 for int8, 7 for int4; s = 1 for an all-zero group)
    q[n, k] = clamp(round(W[n, k] / s[n, k // G]), -Q, Q)
    W'[n, k] = q[n, k] * s[n, k // G]          (what the runtime computes with)

so each weight is off by at most ``s / 2``, half a step of its own group, and a group with one large weight
does not flatten the whole row. ``s`` is stored in float16 and computed from the float16 scale
(``W / s16``), so the stored ``q`` and ``s`` alone give ``W'`` bit for bit.

Stored bytes of one tensor: ``q`` first (int8: one byte per weight; int4: ``q + 8`` in a nibble, the even
column in the low nibble, two weights per byte), then the scales, ``N * K / G`` float16 values. For the tiny
model's float16 experts with ``G = 64`` that is ``1 + 2/64`` bytes per weight at int8 (0.52 of float16) and
``1/2 + 2/64`` at int4 (0.27 of float16).

The runtime moves and holds these bytes and dequantizes an expert with the two lines of ``dequantize`` each
time it computes with it (no weight-only matmul kernel of PyTorch takes this layout on every device; the
docs page measures what dequantizing costs).
"""

from __future__ import annotations

import math

from moe_offload.plan.choices import EXPERT_DTYPES  # noqa: F401 (hardware/profile.py reads it here)

QUANTIZED = {"int8": 127, "int4": 7}  # expert dtype -> the largest |q|
SCALE_BYTES = 2  # float16


def group_size(columns: int) -> int:
    """The largest of 64, 32, ... 2 that divides ``columns`` (each group spans whole columns of one row)."""
    return next((g for g in (64, 32, 16, 8, 4, 2) if columns % g == 0), 1)


def quantized_nbytes(shape, expert_dtype: str) -> int:
    """Bytes of one tensor of ``shape`` stored as ``expert_dtype`` (values, then scales)."""
    rows, columns = math.prod(shape[:-1]), shape[-1]
    values = rows * columns if expert_dtype == "int8" else -(-rows * columns // 2)
    return values + rows * (columns // group_size(columns)) * SCALE_BYTES


def quantize(weight, expert_dtype: str):
    """The stored bytes of ``weight`` (a uint8 tensor of ``quantized_nbytes``), per the module docstring."""
    import torch

    limit = QUANTIZED[expert_dtype]
    rows, columns = math.prod(weight.shape[:-1]), weight.shape[-1]
    group = group_size(columns)
    grouped = weight.detach().to(torch.float32).reshape(rows, columns // group, group)
    scales = (grouped.abs().amax(dim=-1) / limit).to(torch.float16)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.clamp(torch.round(grouped / scales.to(torch.float32)[..., None]), -limit, limit).to(torch.int8)
    q = q.reshape(rows, columns)
    if expert_dtype == "int4":
        nibbles = (q + 8).to(torch.uint8).reshape(-1)
        if nibbles.numel() % 2:
            nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
        values = nibbles[0::2] | (nibbles[1::2] << 4)
    else:
        values = q.reshape(-1).view(torch.uint8)
    return torch.cat([values, scales.reshape(-1).view(torch.uint8)])


def dequantize(stored, shape, expert_dtype: str, dtype):
    """``W'`` of ``shape`` in ``dtype`` from ``stored``, the uint8 bytes ``quantize`` wrote (on any device)."""
    import torch

    rows, columns = math.prod(shape[:-1]), shape[-1]
    group = group_size(columns)
    count = rows * columns
    if expert_dtype == "int4":  # the nibbles straight into float32 (small integers: exact), then q = nibble - 8
        packed = stored[:-(-count // 2)]
        pairs = torch.empty(packed.numel(), 2, dtype=torch.float32, device=stored.device)
        pairs[:, 0] = packed & 0x0F  # the even column
        pairs[:, 1] = packed >> 4
        q = pairs.view(-1)[:count].sub_(8)
        values_bytes = packed.numel()
    else:
        q = stored[:count].view(torch.int8).to(torch.float32)
        values_bytes = count
    scales = stored[values_bytes:].view(torch.float16).to(torch.float32).reshape(rows, columns // group, 1)
    weight = q.view(rows, columns // group, group).mul_(scales)
    return weight.view(shape).to(dtype)
