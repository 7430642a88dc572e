"""The host's expert in the runtime's compute dtype: the host copy converted as the fast tier converts it, bit
for bit, and ``hardware measure`` timing the host's expert in the dtype the runtime computes with."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from moe_offload.models.host_experts import compute_ready  # noqa: E402


def every_value(dtype):
    """Each of the 65,536 bit patterns of a 16-bit float dtype once."""
    return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("stored, compute", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_every_16_bit_value_converts_to_the_fast_tiers_bits(stored, compute):
    """compute_ready and the data path's copy_serially (a fast-tier slot) go through float32 between the two
    16-bit dtypes; the direct copy_ is the reference. Both round the exact float32 value to nearest even:
    equal bits for every value but NaN, whose payload is not arithmetic (NaN must stay NaN)."""
    from moe_offload.runtime.cpu_threads import copy_serially

    values = every_value(stored)
    theirs = torch.empty(values.shape, dtype=compute).copy_(values)
    slot = torch.empty(values.shape, dtype=compute)
    copy_serially(slot, values)  # how the data path fills a fast-tier slot (through float32 too)
    nan = torch.isnan(theirs)
    for ours in (compute_ready(values, compute), slot):
        assert ours.dtype == compute
        assert torch.equal(torch.isnan(ours), nan)
        assert torch.equal(ours[~nan].view(torch.int16), theirs[~nan].view(torch.int16))


def test_a_weight_already_in_the_compute_dtype_is_the_weight_itself():
    weight = torch.ones(3, 2, dtype=torch.bfloat16)
    assert compute_ready(weight, torch.bfloat16) is weight
    assert torch.equal(compute_ready(torch.tensor([1.5, -2.0], dtype=torch.float16), torch.float32),
                       torch.tensor([1.5, -2.0]))


def test_each_role_converts_into_its_own_buffer_at_every_call():
    """No allocation per call (a new tens-of-MiB tensor may page-fault in afresh every time): the same role,
    shape and dtype land in the same memory, with the new weight's values; another role never overwrites it."""
    first = compute_ready(torch.full((4, 3), 1.5, dtype=torch.float16), torch.float32, "gate_up_proj")
    down = compute_ready(torch.full((4, 3), -2.0, dtype=torch.float16), torch.float32, "down_proj")
    second = compute_ready(torch.full((4, 3), 3.0, dtype=torch.float16), torch.float32, "gate_up_proj")
    assert second.data_ptr() == first.data_ptr() and down.data_ptr() != first.data_ptr()
    assert torch.equal(second, torch.full((4, 3), 3.0)) and torch.equal(down, torch.full((4, 3), -2.0))
    via_float32 = compute_ready(torch.full((4, 3), 0.1, dtype=torch.float16), torch.bfloat16, "gate_up_proj")
    again = compute_ready(torch.full((4, 3), 0.2, dtype=torch.float16), torch.bfloat16, "gate_up_proj")
    assert again.data_ptr() == via_float32.data_ptr()
    assert torch.equal(again, torch.full((4, 3), 0.2, dtype=torch.float16).to(torch.bfloat16))
