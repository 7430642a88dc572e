"""What a Hugging Face ``config.json`` says about a model's experts: the shape of its routing and the expert size.

Engines return routing as bare ids, without J (experts per layer) or the size of an expert; the model's
config has them. Fields, by architecture:

* J: ``num_local_experts`` (Mixtral), ``num_experts`` (OLMoE, Qwen2/3-MoE), ``n_routed_experts`` (DeepSeek);
* K: ``num_experts_per_tok``;
* the MoE layers: ``num_hidden_layers`` decoder layers, less DeepSeek's first ``first_k_dense_replace`` dense
  ones (and those off its ``moe_layer_freq``), less Qwen-MoE's ``mlp_only_layers`` and the layers off its
  ``decoder_sparse_step``;
* one expert's weights: a gated MLP of three ``hidden_size x I`` matrices, I = ``moe_intermediate_size``
  (DeepSeek, Qwen-MoE) or ``intermediate_size`` (Mixtral, OLMoE), so ``3 * hidden_size * I * b`` bytes with
  b the bytes of ``torch_dtype`` (2 for bfloat16/float16, 4 for float32).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_offload.errors import ConfigError
from moe_offload.inputs import parse_json, read_text
from moe_offload.trace.format import MAX_EXPERT_BYTES, MAX_EXPERT_SLOTS, MAX_HIDDEN_SIZE
from moe_offload.trace.importers.common import quote

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
# Bounds checked before anything is built from a config: DeepSeek-V3 has 61 decoder layers, so 65,536 is
# a thousand times any model's; the experts of a layer and of the model share the trace's bound.
MAX_DECODER_LAYERS = 2**16


@dataclass(frozen=True)
class ModelShape:
    """The routing shape and sizes of a model, as its config states them."""

    name: str
    num_hidden_layers: int          # decoder layers, dense ones included
    moe_layers: tuple[int, ...]     # decoder-layer index of each MoE layer, in order (L = its length)
    num_experts: int                # J
    top_k: int                      # K
    hidden_size: int | None
    expert_bytes: int | None

    @property
    def num_layers(self) -> int:
        return len(self.moe_layers)


def read_model_config(path) -> ModelShape:
    """The :class:`ModelShape` of a Hugging Face config.json; ConfigError naming the file and the field."""
    config = parse_json(read_text(path, "model config"), path, "model config")
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: a model config is a JSON object, not {type(config).__name__}")

    def field(*names: str, required: bool = True, low: int = 1, high: int = MAX_EXPERT_SLOTS) -> int | None:
        for name in names:
            value = config.get(name)
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                    raise ConfigError(f"{path}: {name} must be an integer from {low} to {high:,}, not {quote(value)}")
                return value
        if required:
            raise ConfigError(f"{path}: no {' or '.join(names)}: is this the config.json of an MoE model?")
        return None

    layers = field("num_hidden_layers", high=MAX_DECODER_LAYERS)
    num_experts = field("num_local_experts", "num_experts", "n_routed_experts")
    top_k = field("num_experts_per_tok")
    if top_k > num_experts:
        raise ConfigError(f"{path}: num_experts_per_tok={top_k} exceeds the {num_experts} experts per layer")
    hidden = field("hidden_size", required=False, high=MAX_HIDDEN_SIZE)
    intermediate = field("moe_intermediate_size", "intermediate_size", required=False, high=2**24)
    dtype_name = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    if not isinstance(dtype_name, str):
        raise ConfigError(f"{path}: torch_dtype must be a type name such as 'bfloat16', not {quote(dtype_name)}")
    dtype_bytes = DTYPE_BYTES.get(dtype_name)
    expert_bytes = 3 * hidden * intermediate * dtype_bytes if hidden and intermediate and dtype_bytes else None
    if expert_bytes is not None and expert_bytes > MAX_EXPERT_BYTES:
        raise ConfigError(f"{path}: hidden_size x intermediate size gives experts of {expert_bytes:,} bytes, more "
                          f"than the {MAX_EXPERT_BYTES:,} this release handles")
    first_dense = field("first_k_dense_replace", required=False, low=0, high=layers)  # DeepSeek
    frequency = field("moe_layer_freq", required=False, high=layers) or 1
    step = field("decoder_sparse_step", required=False, high=layers) or 1  # Qwen-MoE
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in dense):
        raise ConfigError(f"{path}: mlp_only_layers must be a list of layer numbers, not {quote(dense)}")
    if first_dense is not None:
        moe_layers = tuple(layer for layer in range(first_dense, layers) if layer % frequency == 0)
    else:
        dense = set(dense)
        moe_layers = tuple(layer for layer in range(layers) if layer not in dense and (layer + 1) % step == 0)
    if not moe_layers:
        raise ConfigError(f"{path}: no decoder layer of this config is an MoE layer")
    if len(moe_layers) * num_experts > MAX_EXPERT_SLOTS:
        raise ConfigError(f"{path}: {len(moe_layers)} MoE layers x {num_experts} experts is more than the "
                          f"{MAX_EXPERT_SLOTS:,} experts this release handles")
    name = config.get("_name_or_path") or config.get("model_type") or "unknown"
    return ModelShape(name=str(name)[:200], num_hidden_layers=layers, moe_layers=moe_layers,
                      num_experts=num_experts, top_k=top_k, hidden_size=hidden, expert_bytes=expert_bytes)
