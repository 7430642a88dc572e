"""PyTorch's weight-only int4 matmul on a CPU, fed from the packed int4 experts (runtime/quantize.py).

``torch.ops.aten._weight_int4pack_mm_for_cpu(x, B, G, SZ)`` computes ``x @ W'.T`` for a weight ``W'`` [N, K]
held as 4-bit codes ``c`` in ``0..15`` with, per group ``g`` of ``G`` input columns of row ``n``, a scale and a
zero point ``SZ[g, n] = (s, z)``:

    W'[n, k] = (c[n, k] - 8) * s[n, k // G] + z[n, k // G]

The pack stores ``c = q + 8`` (q in -7..7, the symmetric code) and ``s`` (float16), so with ``z = 0`` the
kernel's weight is ``q * s``: exactly the weight the pack dequantizes to. Nothing is re-quantized; the
conversion on arrival (:func:`kernel_tensors`) only rearranges bytes:

- the codes, two per byte in the pack's row-major order (even column in the low nibble), are unpacked to an
  int32 [N, K] matrix and handed to ``_convert_weight_to_int4pack_for_cpu``, which tiles them as this CPU's
  kernel reads them ([N, K/2] bytes, the same count: the layout depends on the CPU's vector width, so it is made
  on arrival and never stored);
- the scales, [N, K/G] float16 in the pack, become ``SZ`` [K/G, N, 2] in the compute dtype (the kernel takes
  scales in the activations' dtype), zeros beside them. That is ``2 * itemsize`` bytes per group instead of 2,
  so a converted expert is a little larger than the stored one (:func:`kernel_nbytes`).

The kernel takes groups of 32, 64, 128 or 256 columns and a row count divisible by 16 (it packs rows in tiles of
16 or more; checked by ``_convert_weight_to_int4pack_for_cpu``), so :func:`kernel_takes` says whether an expert's
tensors qualify. It is not bit-identical to ``F.linear`` over the dequantized weight (it sums in another order
and, for bfloat16 activations, accumulates in float32 before one rounding): a run with the kernel is lossless
against the all-resident engine computing with the same kernel, and within float tolerance of the dequantized
products (tests/test_expert_forms.py).
"""

from __future__ import annotations

from moe_offload.runtime.quantize import group_size

KERNEL_GROUPS = (32, 64, 128, 256)
ROW_TILE = 16


class Int4Weight:
    """One weight [N, K] as the kernel takes it: ``packed`` [N, K/2] uint8 (this CPU's tiles), ``scales_zeros``
    [K/G, N, 2] in the compute dtype, ``group`` = G."""

    __slots__ = ("packed", "scales_zeros", "group", "shape")

    def __init__(self, packed, scales_zeros, group: int, shape):
        self.packed, self.scales_zeros, self.group, self.shape = packed, scales_zeros, group, tuple(shape)

    def linear(self, x):
        """``x`` [..., K] times the weight transposed, as ``F.linear`` (the kernel takes one contiguous matrix)."""
        import torch

        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales_zeros)
        return out.reshape(*x.shape[:-1], self.shape[0])


def kernel_takes(shapes) -> bool:
    """Whether the kernel takes every weight of ``shapes`` ([N, K] each) in the pack's groups."""
    return all(len(shape) == 2 and group_size(shape[1]) in KERNEL_GROUPS and shape[0] % ROW_TILE == 0
               for shape in shapes)


def _part_bytes(shape, itemsize: int) -> tuple[int, int]:
    rows, columns = shape
    return rows * columns // 2, (columns // group_size(columns)) * rows * 2 * itemsize


def kernel_nbytes(shapes, itemsize: int) -> int:
    """Bytes of one expert converted for the kernel: per weight the tiled codes, then ``SZ`` in a dtype of
    ``itemsize`` bytes."""
    return sum(sum(_part_bytes(shape, itemsize)) for shape in shapes)


def convert(stored: dict, destination, dtype) -> None:
    """Write the kernel's form of an expert into ``destination`` (a uint8 tensor of :func:`kernel_nbytes`):
    ``stored`` maps each weight's name to (its stored bytes, its shape), in the order of the slot."""
    import torch

    offset = 0
    for region, shape in stored.values():
        rows, columns = shape
        codes_bytes, sz_bytes = _part_bytes(shape, dtype.itemsize)
        packed = region[:codes_bytes]
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(rows, columns).to(torch.int32)
        destination[offset:offset + codes_bytes].copy_(
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1).reshape(-1))
        offset += codes_bytes
        scales = region[codes_bytes:].view(torch.float16).reshape(rows, columns // group_size(columns))
        target = destination[offset:offset + sz_bytes].view(dtype).view(columns // group_size(columns), rows, 2)
        target[..., 0].copy_(scales.t())
        target[..., 1].zero_()
        offset += sz_bytes


def kernel_tensors(region, shapes: dict, dtype) -> dict:
    """The :class:`Int4Weight` views of ``region``, an expert that :func:`convert` wrote (``shapes``: name ->
    [N, K], in the slot's order)."""
    out, offset = {}, 0
    for name, shape in shapes.items():
        rows, columns = shape
        codes_bytes, sz_bytes = _part_bytes(shape, dtype.itemsize)
        group = group_size(columns)
        packed = region[offset:offset + codes_bytes].view(rows, columns // 2)
        offset += codes_bytes
        scales_zeros = region[offset:offset + sz_bytes].view(dtype).view(columns // group, rows, 2)
        offset += sz_bytes
        out[name] = Int4Weight(packed, scales_zeros, group, shape)
    return out
