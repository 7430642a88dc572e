"""What each way of computing with an expert costs on this machine, and the runtime's choices made from it.

For one real expert of the packed model, stored as float16 and, quantized in memory as ``pack`` would store
it, as int8 and int4 (runtime/quantize.py), in each compute dtype the device offers for the fast tier
(float32, bfloat16 and float16 on a CPU; the stored float dtype on a GPU), every form of runtime/expert_forms.py
that runs there is timed as the runtime runs it:

- ``float``: a float pack's slot, the weights in the compute dtype (the float16 experts' only form);
- ``per-use``: each step dequantizes the stored bytes, then multiplies (models/experts.py's body);
- ``on-arrival``: the weights dequantized once into a float slot (the conversion timed apart: ``arrival_s``);
- ``kernel``: int4 codes converted once for PyTorch's weight-only int4 kernel, which computes each step.

Each at 1 token (a decoding step gives an expert one token) and 32 (a prefill's share), medians over the
repeats. :func:`runtime_choices` picks from them what ``generate`` and ``serve`` use when they are given the
profile and no ``--dtype`` / ``--expert-compute``: per expert dtype, the (compute dtype, form) with the least
one-token time (a decode step's, which TPOT is made of) among the forms that keep an expert's bytes near its
stored size (``float`` for a float pack, ``per-use`` and ``kernel`` for int8/int4; ``on-arrival`` holds float
bytes, which gives up the capacity quantizing was for, so it is timed but never chosen) and whose 32-token
time is within PREFILL_SLACK of the best: a dtype without a fast path for many rows (float16 on most CPUs, the
int4 kernel's scalar loop) would make every prompt several times slower for a one-token time that is at best
even with the others'.
"""

from __future__ import annotations

import dataclasses

FORM_TOKENS = (1, 32)
EXPERT_DTYPES = ("float16", "int8", "int4")
CHOOSABLE = ("float", "per-use", "kernel")
PREFILL_SLACK = 4.0  # a choice's 32-token time may be at most this many times the best one's


def stored_expert(manifest, tensors: dict, expert_dtype: str):
    """(a manifest of ``expert_dtype`` experts shaped as ``manifest``'s, one expert's stored bytes) from its
    float ``tensors``: the bytes ``pack --expert-dtype`` writes."""
    import torch

    from moe_offload.runtime.packing import TensorEntry
    from moe_offload.runtime.quantize import quantize

    parts, entries, offset = [], [], 0
    for entry in manifest.tensors:
        weight = tensors[entry.name].to(torch.float16)
        stored = quantize(weight, expert_dtype) if expert_dtype != "float16" else weight.reshape(-1).view(torch.uint8)
        entries.append(TensorEntry(entry.name, tuple(entry.shape), offset, stored.numel()))
        parts.append(stored)
        offset += stored.numel()
    quantized = expert_dtype != "float16"
    form_manifest = dataclasses.replace(manifest, dtype="float16", expert_bytes=offset, tensors=tuple(entries),
                                        expert_dtype=expert_dtype if quantized else None)
    return form_manifest, torch.cat(parts)


def compute_dtypes(device, stored_dtype: str) -> tuple[str, ...]:
    """The fast tier's compute dtypes timed on ``device``: each of float32, bfloat16 and float16 on a CPU, the
    stored dtype on a GPU (the runtime's default there)."""
    return ("float32", "bfloat16", "float16") if device.type == "cpu" else (stored_dtype,)


def measure_forms(manifest, tensors: dict, experts_module, device, repeats: int,
                  token_counts=FORM_TOKENS) -> dict:
    """expert dtype -> compute dtype -> form -> {"seconds": {n: s}, "arrival_s": s, "slot_bytes": b} for the
    expert whose float ``tensors`` (CPU) are given (module docstring)."""
    import torch

    from moe_offload.runtime.expert_forms import FORM_CLASSES, kernel_runs
    from moe_offload.runtime.measure.compute import measure_expert_compute
    from moe_offload.runtime.measure.timing import time_per_call

    results: dict = {}
    for expert_dtype in EXPERT_DTYPES:
        form_manifest, stored = stored_expert(manifest, tensors, expert_dtype)
        for dtype_name in compute_dtypes(device, manifest.dtype):
            dtype = getattr(torch, dtype_name)
            timed = results.setdefault(expert_dtype, {}).setdefault(dtype_name, {})
            if expert_dtype == "float16":
                seconds, _ = measure_expert_compute(experts_module, tensors, device, dtype, repeats, token_counts)
                elements = sum(t.numel() for t in tensors.values())
                timed["float"] = {"seconds": seconds, "arrival_s": 0.0, "slot_bytes": elements * dtype.itemsize}
                continue
            for name, form_class in FORM_CLASSES.items():
                if (name == "kernel" and kernel_runs(form_manifest, device, dtype) is not None) or \
                        (name != "per-use" and device.type != "cpu"):
                    continue
                form = form_class(form_manifest, dtype)
                slot = torch.empty(form.slot_elements, dtype=form.slot_dtype)
                arrival = time_per_call(lambda: form.convert(stored, slot), repeats)
                on_device = stored.to(device) if name == "per-use" else slot

                def weights(form=form, on_device=on_device):
                    return form.tensors(on_device, 0)
                seconds, _ = measure_expert_compute(experts_module, tensors, device, dtype, repeats, token_counts,
                                                    weights=weights)
                timed[name] = {"seconds": seconds, "arrival_s": arrival, "slot_bytes": form.slot_bytes}
    return results


def runtime_choices(forms: dict) -> dict:
    """{"dtype": {expert dtype: compute dtype}, "expert_compute": {expert dtype: form}} (int8/int4 only in the
    latter; the float16 expert's choice is also a bfloat16 pack's): per expert dtype the least one-token time
    among the CHOOSABLE forms whose most-token time is within PREFILL_SLACK of the best (module docstring)."""
    choices: dict = {"dtype": {}, "expert_compute": {}}
    for expert_dtype, by_dtype in forms.items():
        candidates = [(timed["seconds"], dtype, form) for dtype, by_form in by_dtype.items()
                      for form, timed in by_form.items() if form in CHOOSABLE]
        fewest, most = min(candidates[0][0]), max(candidates[0][0])
        best_many = min(seconds[most] for seconds, _, _ in candidates)
        _, dtype, form = min((seconds[fewest], dtype, form) for seconds, dtype, form in candidates
                             if seconds[most] <= PREFILL_SLACK * best_many)
        if form == "float":  # float weights compute alike whatever float dtype the pack stores
            choices["dtype"].update({"float16": dtype, "bfloat16": dtype})
        else:
            choices["dtype"][expert_dtype] = dtype
            choices["expert_compute"][expert_dtype] = form
    return choices


def forms_source(forms: dict) -> str:
    """The profile's source line for the measurements behind its ``[runtime]`` choices."""
    parts = []
    for expert_dtype, by_dtype in forms.items():
        for dtype, by_form in by_dtype.items():
            for form, timed in by_form.items():
                times = "/".join(f"{s * 1e6:.1f}" for _, s in sorted(timed["seconds"].items()))
                parts.append(f"{expert_dtype} {form} in {dtype} {times} us")
    tokens = "/".join(str(n) for n in FORM_TOKENS)
    return (f"runtime: one expert at {tokens} tokens (runtime/measure/forms.py): " + "; ".join(parts)
            + "; per expert dtype the least one-token time among float, per-use and kernel, within "
            + f"{PREFILL_SLACK:g}x of the best {FORM_TOKENS[-1]}-token time, sets [runtime]")


def quantized_weights(manifest, key, device, dtype, host: bool = False):
    """For a quantized pack, the expert ``key``'s weights as the runtime's fast tier gives them at each use (its
    form, runtime/expert_forms.py: dequantized per use, or converted once), or with ``host`` as the host tier
    gives a bypassed one (made compute-ready from the stored bytes at every call); None for a float pack."""
    if not manifest.quantized:
        return None
    import torch

    from moe_offload.runtime.expert_forms import expert_form
    from moe_offload.runtime.storage import ExpertStore

    form = expert_form(None, manifest, device, dtype)
    stored = torch.empty(manifest.expert_bytes, dtype=torch.uint8)
    array = stored.numpy()
    store = ExpertStore(manifest)
    try:
        store.read(*key, lambda start, end: memoryview(array[start:end]))
    finally:
        store.close()
    if host:
        return lambda: form.from_stored(stored)
    slot = torch.empty(form.slot_elements, dtype=form.slot_dtype)
    form.convert(stored, slot)
    slot = slot.to(device)
    return lambda: form.tensors(slot, 0)
