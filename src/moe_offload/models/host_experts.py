"""Experts computed on the host: how a bypassed expert is served where it lives.

A placement that does not admit a missed expert into the fast tier (simulator/cache.py: the miss is
*bypassed*) leaves it in host memory, and the layer computes it there, as llama.cpp's ``--n-cpu-moe`` and
ktransformers compute the experts they keep in system memory. The expert source marks such an expert's
tensors with :data:`ON_HOST`: they are the host tier's copy (the stored dtype, in CPU memory), not a
compute-ready copy in the fast tier.

The arithmetic is the fast tier's: the weights are converted to the dtype of the hidden states, and the
same products run on the same rows, so on a machine without a GPU (where the fast tier is CPU memory in
float32 and the host copy is float16) a bypassed expert gives exactly the bits of a resident one, and
generation stays lossless against the all-resident model. Converting float16 or bfloat16 to float32 is
exact, and ``F.linear`` on equal inputs gives equal outputs. Quantized experts (int8/int4) stay as stored
bytes in the host tier; the fast tier's form (runtime/expert_forms.py) makes them compute-ready for the host
(dequantized, or converted for the int4 kernel), so the host computes what the fast tier would, bit for bit.

With CUDA the hidden states of the layer are copied to pinned host memory once, the first time a bypassed
expert needs them, on a side stream that waits only for an event recorded when the layer's expert
computation began: the copy does not wait for the resident experts' kernels queued since, so those run on
the GPU while the host computes. The host's result is copied back to the GPU; the layer adds it with the
others in ascending expert order, as always. CPU kernels do not give a GPU's bits, so there the reference
is the same arithmetic on the host (the CUDA tests compare within float tolerance).
"""

from __future__ import annotations

import threading

ON_HOST = "on_host"  # the key an expert source sets in an expert's tensors when they are the host tier's copy

_side_streams: dict = {}  # CUDA device -> the stream that copies hidden states to the host


class HostInputs:
    """One layer call's hidden states, as the host computes from them: copied to the host at most once.
    ``module``: the experts module; only when its expert source ``computes_on_host`` is the event recorded
    that lets the copy skip the layer's GPU kernels (otherwise the copy, never expected, waits for them)."""

    def __init__(self, module, hidden_states):
        self.hidden_states = hidden_states
        self._host = None
        self._began = None
        if hidden_states.is_cuda and getattr(getattr(module, "expert_source", None), "computes_on_host", False):
            import torch

            self._began = torch.cuda.Event()
            self._began.record()  # before any expert kernel of the layer: the copy need not wait for them

    def rows(self, token_idx):
        """The host's rows ``token_idx`` (a CPU index tensor; None: every row)."""
        if self._host is None:
            self._host = self._to_host()
        return self._host if token_idx is None else self._host[token_idx]

    def _to_host(self):
        if self._began is None:
            return self.hidden_states.cpu()
        import torch

        device = self.hidden_states.device
        stream = _side_streams.get(device)
        if stream is None:
            stream = _side_streams[device] = torch.cuda.Stream(device=device)
        host = torch.empty(self.hidden_states.shape, dtype=self.hidden_states.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            stream.wait_event(self._began)
            host.copy_(self.hidden_states, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        copied.synchronize()
        return host


def host_expert_output(module, inputs: HostInputs, token_idx, weights: dict, product):
    """The expert's output for rows ``token_idx`` (CPU index, None: every row), computed on the host from the
    host copy ``weights`` with ``product(x, weight)`` (``F.linear``, or a packed pass's per-request products),
    on the device of the hidden states."""
    x = inputs.rows(token_idx)
    gate_up = compute_ready(weights["gate_up_proj"], x.dtype, "gate_up_proj")
    down = compute_ready(weights["down_proj"], x.dtype, "down_proj")
    current = product(module._apply_gate(product(x, gate_up)), down)
    return current.to(inputs.hidden_states.device, non_blocking=True)


_converted = threading.local()  # per computing thread: (role, shape, dtype) -> the buffer converted into


def compute_ready(weight, dtype, role: str = ""):
    """A float weight of the host copy in the compute ``dtype`` (quantized experts come compute-ready from the
    fast tier's form, runtime/expert_forms.py: the int4 kernel's weight as it is), converted into this
    thread's buffer for ``role`` (the weight's name) and its shape and dtype: valid until the thread converts
    the next weight of that role, which is after the products that use it.

    A buffer, not a new tensor at every call: a wide expert's converted weights are tens of MiB, above the
    size glibc's malloc maps afresh from the kernel, and depending on the heap's history it gives them back
    at every free, so every call page-faults its output in (measured on a 2-core AMD EPYC: up to 126 of 177
    calls of a replay, ~7 ms each against ~2 ms). Between float16 and bfloat16 the conversion goes through
    float32: widening either is exact, and narrowing rounds to nearest even, as the direct conversion does,
    so the bits are the fast tier's; but PyTorch's CPU kernel converts float16 to bfloat16 directly one
    element at a time, three times as long as the two vectorized steps (4M elements: 2.8 ms against 0.9 ms)."""
    import torch

    if not isinstance(weight, torch.Tensor) or weight.dtype == dtype:
        return weight
    if {weight.dtype, dtype} == {torch.float16, torch.bfloat16}:
        weight = _buffer(role, weight.shape, torch.float32).copy_(weight)
    return _buffer(role, weight.shape, dtype).copy_(weight)


def _buffer(role: str, shape, dtype):
    import torch

    buffers = _converted.__dict__.setdefault("buffers", {})
    key = (role, tuple(shape), dtype)
    buffer = buffers.get(key)
    if buffer is None:
        buffer = buffers[key] = torch.empty(shape, dtype=dtype)
    return buffer
