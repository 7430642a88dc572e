"""How the fast tier holds and computes with quantized experts (``--expert-compute``): three forms.

The links always move the stored bytes (runtime/quantize.py). What the fast tier's slot then holds:

- ``per-use``: the stored bytes as they are; each time the layer computes with the expert, its weights are
  dequantized (quantize.dequantize) into fresh float tensors and multiplied with ``F.linear``. A slot is the
  stored expert, so a byte budget holds the most experts (``expert_bytes`` each).
- ``on-arrival``: the expert is dequantized once, when it lands, into a slot of float weights in the compute
  dtype; each use is a plain ``F.linear``. The same bits as ``per-use`` (the same dequantization, the same
  products), faster per use, but a slot is the float expert (``elements * itemsize`` bytes, as a float pack's
  slot), so a byte budget holds only as many experts as a float pack's.
- ``kernel``: int4 experts converted on arrival to the layout of PyTorch's weight-only int4 matmul for the CPU
  (runtime/int4_kernel.py), which computes from the 4-bit codes directly. A slot is the codes plus a scale and a
  zero per group in the compute dtype (``kernel_nbytes``: 6% more than the stored expert in bfloat16).

The budget counts the slot's bytes, whatever the form: what the fast tier really holds.

``auto`` picks by the measurement of docs/guides/checkpoints.md (``benchmarks/expert_compute.py``): on a CPU
the int4 kernel with bfloat16 activations takes less time than the same product on float weights (the codes
are a quarter of the bytes read, and ATen vectorizes it for bfloat16), while for float32 and float16
activations ATen runs its scalar loop, slower than dequantizing at every use. So ``auto`` is ``kernel`` for
int4 experts computed in bfloat16 on a CPU, when the kernel takes the expert's shapes, and ``per-use``
otherwise: ``on-arrival`` gives up the capacity that quantizing was for, so it is chosen only by name. On CUDA
only ``per-use`` runs (the CUDA kernel has its own layout, not wired here).

The host tier (models/host_experts.py) holds the stored bytes; an expert the layer computes there is made
compute-ready from them by the fast tier's form (:meth:`ExpertForm.from_stored`), so it gives the bits it would
give in the fast tier.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

from moe_offload.errors import ConfigError
from moe_offload.plan.choices import EXPERT_COMPUTE as CHOICES, EXPERT_FORMS as FORMS
from moe_offload.runtime.cpu_threads import single_threaded



class ExpertForm(ABC):
    """One form of a quantized expert in the fast tier: the slot's dtype and element count, the conversion of
    the stored bytes into a slot, and the slot's compute-ready weights."""

    name = ""
    converts = True  # the data path converts the stored bytes into the slot (else it copies them)

    def __init__(self, manifest, dtype, slot_dtype, slot_elements: int):
        self.manifest, self.dtype = manifest, dtype
        self.slot_dtype, self.slot_elements = slot_dtype, slot_elements  # what one slot of the fast tier holds
        self._views: dict[int, dict] = {}  # slot -> its weights, for forms whose slot holds them as they are

    @property
    def slot_bytes(self) -> int:
        return self.slot_elements * self.slot_dtype.itemsize

    def stored_tensors(self, stored) -> dict:
        """name -> (its stored bytes in ``stored``, an expert's uint8 region, its shape)."""
        return {tensor.name: (stored[tensor.offset:tensor.offset + tensor.nbytes], tuple(tensor.shape))
                for tensor in self.manifest.tensors}

    def convert(self, stored, destination) -> None:
        """Write the slot ``destination`` from the stored bytes ``stored`` (on a reader or link worker thread,
        without an OpenMP team: runtime/cpu_threads.py)."""
        with single_threaded():
            self._convert(stored, destination)

    @abstractmethod
    def _convert(self, stored, destination) -> None:
        """Write the slot ``destination`` from ``stored`` on the calling thread."""

    def tensors(self, region, slot: int) -> dict:
        """The weights of the expert in ``region``, the slot ``slot``, ready for models/experts.py."""
        views = self._views.get(slot)
        if views is None:
            views = self._views[slot] = self._views_of(region)
        return views

    @abstractmethod
    def _views_of(self, region) -> dict:
        """The compute-ready weights of the slot ``region``."""

    def from_stored(self, stored) -> dict:
        """Compute-ready weights from the stored bytes (the host tier's copy), the bits of the fast tier's."""
        import torch

        slot = torch.empty(self.slot_elements, dtype=self.slot_dtype)
        self._convert(stored, slot)
        return self._views_of(slot)


class PerUse(ExpertForm):
    name, converts = "per-use", False

    def __init__(self, manifest, dtype):
        import torch

        super().__init__(manifest, dtype, torch.uint8, manifest.expert_bytes)

    def _convert(self, stored, destination) -> None:
        destination.copy_(stored)

    def tensors(self, region, slot: int) -> dict:
        return self._views_of(region)  # at each call: a copy kept per slot would be stale once it holds another

    def _views_of(self, region) -> dict:
        from moe_offload.runtime.quantize import dequantize

        return {name: dequantize(stored, shape, self.manifest.expert_dtype, self.dtype)
                for name, (stored, shape) in self.stored_tensors(region).items()}

    def from_stored(self, stored) -> dict:
        return self._views_of(stored)


class OnArrival(ExpertForm):
    name = "on-arrival"

    def __init__(self, manifest, dtype):
        super().__init__(manifest, dtype, dtype, sum(math.prod(tensor.shape) for tensor in manifest.tensors))

    def _convert(self, stored, destination) -> None:
        from moe_offload.runtime.quantize import dequantize

        views = self._views_of(destination)
        for name, (region, shape) in self.stored_tensors(stored).items():
            views[name].copy_(dequantize(region, shape, self.manifest.expert_dtype, self.dtype))

    def _views_of(self, region) -> dict:
        out, first = {}, 0
        for tensor in self.manifest.tensors:
            count = math.prod(tensor.shape)
            out[tensor.name] = region[first:first + count].view(tuple(tensor.shape))
            first += count
        return out


class Kernel(ExpertForm):
    name = "kernel"

    def __init__(self, manifest, dtype):
        import torch

        from moe_offload.runtime.int4_kernel import kernel_nbytes

        shapes = [tuple(tensor.shape) for tensor in manifest.tensors]
        super().__init__(manifest, dtype, torch.uint8, kernel_nbytes(shapes, dtype.itemsize))

    def _convert(self, stored, destination) -> None:
        from moe_offload.runtime.int4_kernel import convert

        convert(self.stored_tensors(stored), destination, self.dtype)

    def _views_of(self, region) -> dict:
        from moe_offload.runtime.int4_kernel import kernel_tensors

        return kernel_tensors(region, {tensor.name: tuple(tensor.shape) for tensor in self.manifest.tensors},
                              self.dtype)


class StoredCopy:
    """The host tier's slots of quantized experts: the stored bytes, made compute-ready by the fast tier's form
    each time the host computes with one."""

    converts = False

    def __init__(self, form: ExpertForm):
        self.form = form

    def tensors(self, region, slot: int) -> dict:
        return self.form.from_stored(region)


FORM_CLASSES = {"per-use": PerUse, "on-arrival": OnArrival, "kernel": Kernel}


def kernel_runs(manifest, device, dtype) -> str | None:
    """Why the int4 kernel cannot compute ``manifest``'s experts on ``device`` in ``dtype``; None when it can."""
    import torch

    from moe_offload.runtime.int4_kernel import kernel_takes

    if manifest.expert_dtype != "int4":
        return f"the weight-only kernel takes int4 experts, not {manifest.expert_dtype}"
    if device.type != "cpu":
        return "the weight-only int4 kernel runs on a CPU here"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the weight-only int4 kernel takes float activations, not {dtype}"
    if not kernel_takes([tuple(tensor.shape) for tensor in manifest.tensors]):
        return ("the weight-only int4 kernel takes groups of 32 to 256 columns and rows in multiples of 16; "
                f"this model's experts are {', '.join(str(tuple(t.shape)) for t in manifest.tensors)}")
    return None


def expert_form(choice: str | None, manifest, device, dtype) -> ExpertForm | None:
    """The form ``choice`` (None or "auto": the rule of the module docstring) of ``manifest``'s experts in a fast
    tier on ``device`` computing in ``dtype``; None for a float pack (its slot holds float weights as always).
    A form that cannot run there is refused in one line."""
    import torch

    if choice is not None and choice not in CHOICES:
        raise ConfigError(f"--expert-compute {choice!r}: choose from {', '.join(CHOICES)}")
    if not manifest.quantized:
        if choice not in (None, "auto"):
            raise ConfigError(f"--expert-compute {choice}: {manifest.directory} holds {manifest.dtype} experts; "
                              "the forms are for int8/int4 packs")
        return None
    if choice in (None, "auto"):
        fast = dtype == torch.bfloat16 and kernel_runs(manifest, device, dtype) is None
        choice = "kernel" if fast else "per-use"
    elif choice == "kernel":
        why = kernel_runs(manifest, device, dtype)
        if why is not None:
            raise ConfigError(f"--expert-compute kernel: {why}")
    elif choice == "on-arrival" and device.type != "cpu":
        raise ConfigError("--expert-compute on-arrival: dequantizing on arrival runs on a CPU fast tier here; "
                          "use per-use on CUDA")
    return FORM_CLASSES[choice](manifest, dtype)


def profile_choices(hardware, manifest, device) -> tuple[str | None, str | None]:
    """(compute dtype, form) that the measured profile ``hardware`` (a HardwareProfile, a preset's name or a
    file; None: none) chose for ``manifest``'s experts on a ``device`` of the kind it was measured on
    (hardware/profile.py RuntimeChoices); None for what it does not say."""
    if hardware is None:
        return None, None
    from moe_offload.hardware import HardwareProfile, resolve_profile

    profile = hardware if isinstance(hardware, HardwareProfile) else resolve_profile(hardware)
    if profile.runtime is None or profile.runtime.device != device.type:
        return None, None
    stored = manifest.expert_dtype or manifest.dtype
    return profile.runtime.dtype.get(stored), profile.runtime.expert_compute.get(stored)
