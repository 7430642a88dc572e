"""The skeleton of a packed model: the model as its config.json builds it, with every non-expert weight loaded
from the pack's non-expert file (checked against the manifest's SHA-256 and its shapes first) and no expert
weight at all. The runtime's tiers give the experts (models/experts.py ExpertSource) at run time."""

from __future__ import annotations

import time
from pathlib import Path

from moe_offload.inputs import file_sha256
from moe_offload.models.adapters import MoeAdapter, architecture_of, read_config
from moe_offload.runtime.packing import MANIFEST, NON_EXPERTS, Manifest, PackError, expert_parameter_names


def load_skeleton(manifest: Manifest, device="cpu", dtype=None, verify: bool = True):
    """The model with every non-expert weight loaded and no expert weight at all (the fused expert tensors
    are empty): (model, adapter, seconds). Expert weights come from an ExpertSource at run time."""
    import torch
    import transformers
    from safetensors.torch import load_file

    started = time.perf_counter()
    config = read_config(manifest.directory)
    spec = architecture_of(config)
    config._experts_implementation = "eager"
    with torch.device("meta"):
        model = getattr(transformers, spec.causal_lm)(config)
    adapter = MoeAdapter(model, stored_dtype=manifest.dtype)
    if adapter.decoder_layers != manifest.decoder_layers or adapter.num_experts != manifest.num_experts:
        raise PackError(f"{manifest.directory}: config.json and the manifest disagree on the MoE layers")
    file = manifest.directory / NON_EXPERTS
    _check_shapes(model, adapter, manifest, file)  # before any memory is allocated for them
    for layer in range(adapter.num_layers):
        module = adapter.experts(layer)
        for name in adapter.EXPERT_TENSORS:  # no storage: the weights live in the tiers
            setattr(module, name, torch.nn.Parameter(torch.empty(0, device=device), requires_grad=False))
    model.to_empty(device=device)
    if verify and file_sha256(file) != manifest.non_experts_sha256:
        raise PackError(f"{file}: checksum mismatch with the manifest (corrupt or replaced)")
    try:
        state = load_file(file, device=str(device))
    except Exception as exc:  # safetensors raises its own SafetensorError for a corrupt header
        raise PackError(f"{file}: cannot be read: {exc}") from None
    expert_names = expert_parameter_names(adapter)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = set(missing) - expert_names - set(manifest.tied)
    if missing or unexpected:
        problem = f"lacks {sorted(missing)[0]}" if missing else f"has unexpected {sorted(unexpected)[0]}"
        raise PackError(f"{file}: {problem}")
    # Non-persistent buffers (rotary frequencies) are in no file: computed again as from_pretrained computes
    # them, in the dtype the model's code gives them (float32 for rotary frequencies, whatever the weights'
    # dtype); casting them with the weights would change the float16 model's rotations, and its tokens.
    with_buffers = [(module, {name: module._buffers[name].dtype for name in module._non_persistent_buffers_set})
                    for module in model.modules() if getattr(module, "_non_persistent_buffers_set", None)]
    model.to(dtype=dtype or getattr(torch, manifest.dtype))
    with torch.no_grad():
        for name, target in manifest.tied.items():
            model.get_parameter(name).copy_(model.get_parameter(target))
        for module, dtypes in with_buffers:
            for name, buffer_dtype in dtypes.items():
                module._buffers[name] = module._buffers[name].to(buffer_dtype)
            model._init_weights(module)
    return model.eval(), adapter, time.perf_counter() - started


def _check_shapes(model, adapter, manifest: Manifest, file: Path) -> None:
    """PackError unless the model that config.json describes (``model``, on the meta device) has the shapes of
    the manifest's expert tensors and of every tensor in the non-expert file: a hand-edited ``vocab_size`` or
    tensor shape is refused naming the tensor, instead of failing deep in PyTorch (or allocating a vocabulary
    of 10^12 rows)."""
    from safetensors import SafetensorError, safe_open

    expected = {name: tuple(getattr(adapter.experts(0), name).shape[1:]) for name in adapter.EXPERT_TENSORS}
    for tensor in manifest.tensors:
        if expected.get(tensor.name) != tensor.shape:
            raise PackError(f"{manifest.directory / MANIFEST}: expert tensor {tensor.name} has shape "
                            f"{list(tensor.shape)}, config.json gives the model {list(expected.get(tensor.name, ()))}")
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    try:
        with safe_open(file, "pt") as handle:
            for name in handle.keys():
                stored = tuple(handle.get_slice(name).get_shape())
                if name in shapes and stored != shapes[name]:
                    raise PackError(f"{file}: {name} has shape {list(stored)}, config.json gives the model "
                                    f"{list(shapes[name])}")
    except (SafetensorError, OSError) as exc:
        raise PackError(f"{file}: cannot be read: {exc}") from None
