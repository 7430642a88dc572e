"""One expert's forward on this machine in every way the fast tier can hold it: float16, int8 and int4 experts,
each compute dtype, each form of runtime/expert_forms.py (per-use, on-arrival, the int4 kernel), at 1 and 32
tokens, with the conversion on arrival and the bytes a slot takes; beside them PyTorch's per-channel int8
kernel, which the pack's group-wise int8 cannot feed. The measurement is `hardware measure`'s
(runtime/measure/forms.py); the choice it writes to a profile is printed last.

    python benchmarks/expert_compute.py [--repeats 5] [--threads 1] [--json FILE]

On the bundled tiny Mixtral's expert (layer 0, expert 0: gate_up [768, 192], down [192, 384]); about 10 s.
``--threads 1`` by default: on a shared machine torch's thread pool stalls for milliseconds per operation.
"""

from __future__ import annotations

import argparse
import json
import sys


def per_channel_int8(tensors: dict, experts_module, repeats: int) -> dict:
    """compute dtype -> {n: seconds} of the expert through ``torch._weight_int8pack_mm`` (one scale per output
    row, the only int8 layout that kernel takes), measured as the forms are."""
    import torch

    from moe_offload.runtime.measure.compute import measure_expert_compute
    from moe_offload.runtime.measure.forms import FORM_TOKENS

    class PerChannelInt8:
        def __init__(self, weight, dtype):
            scales = weight.float().abs().amax(dim=1) / 127
            self.q = torch.round(weight.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
            self.scales = scales.to(dtype)

        def linear(self, x):  # models/experts.linear hands a weight that is no tensor its own product
            return torch._weight_int8pack_mm(x, self.q, self.scales)

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        ready = {name: PerChannelInt8(weight, dtype) for name, weight in tensors.items()}

        def weights():
            return ready
        seconds, _ = measure_expert_compute(experts_module, tensors, torch.device("cpu"), dtype, repeats,
                                            FORM_TOKENS, weights=weights)
        out[str(dtype).removeprefix("torch.")] = seconds
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import torch

    from moe_offload.runtime.measure.forms import FORM_TOKENS, measure_forms, runtime_choices
    from moe_offload.runtime.pack_cache import packed_directory
    from moe_offload.runtime.packing import read_manifest
    from moe_offload.runtime.skeleton import load_skeleton
    from moe_offload.runtime.storage import ExpertStore

    torch.set_num_threads(args.threads)
    manifest = read_manifest(packed_directory("tiny"))
    cpu = torch.device("cpu")
    _, adapter, _ = load_skeleton(manifest, cpu, torch.float32, verify=False)
    tensors = ExpertStore(manifest).read_tensors(0, 0)
    forms = measure_forms(manifest, tensors, adapter.experts(0), cpu, args.repeats)
    int8_kernel = per_channel_int8(tensors, adapter.experts(0), args.repeats)
    tokens = " | ".join(f"{n} token{'s' if n > 1 else ''}" for n in FORM_TOKENS)
    print(f"one expert of the tiny Mixtral on {cpu}, {args.threads} thread(s), medians of {args.repeats}")
    print(f"| experts | compute dtype | form | slot bytes | on arrival | {tokens} |")
    print("|---|---|---|---|---|" + "---|" * len(FORM_TOKENS))
    for expert_dtype, by_dtype in forms.items():
        for dtype, by_form in by_dtype.items():
            for form, timed in by_form.items():
                times = " | ".join(f"{timed['seconds'][n] * 1e6:.1f} us" for n in FORM_TOKENS)
                print(f"| {expert_dtype} | {dtype} | {form} | {timed['slot_bytes']:,} | "
                      f"{timed['arrival_s'] * 1e6:.1f} us | {times} |")
    for dtype, seconds in int8_kernel.items():
        times = " | ".join(f"{seconds[n] * 1e6:.1f} us" for n in FORM_TOKENS)
        print(f"| int8 per channel (not the pack's) | {dtype} | torch._weight_int8pack_mm | - | - | {times} |")
    choices = runtime_choices(forms)
    print("hardware measure would choose: " + ", ".join(
        f"{expert} -> --dtype {dtype}" + (f" --expert-compute {choices['expert_compute'][expert]}"
                                         if expert in choices["expert_compute"] else "")
        for expert, dtype in choices["dtype"].items()))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"forms": forms, "per_channel_int8": int8_kernel, "choices": choices}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
