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

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


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

    def field(*names: str, required: bool = True) -> int | None:
        for name in names:
            value = config.get(name)
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ConfigError(f"{path}: {name} must be a positive integer, not {value!r}")
                return value
        if required:
            raise ConfigError(f"{path}: no {' or '.join(names)}: is this the config.json of an MoE model?")
        return None

    layers = field("num_hidden_layers")
    num_experts = field("num_local_experts", "num_experts", "n_routed_experts")
    top_k = field("num_experts_per_tok")
    if top_k > num_experts:
        raise ConfigError(f"{path}: num_experts_per_tok={top_k} exceeds the {num_experts} experts per layer")
    hidden = field("hidden_size", required=False)
    intermediate = field("moe_intermediate_size", "intermediate_size", required=False)
    dtype_bytes = DTYPE_BYTES.get(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    expert_bytes = 3 * hidden * intermediate * dtype_bytes if hidden and intermediate and dtype_bytes else None
    moe_layers = tuple(layer for layer in range(layers) if _is_moe_layer(config, layer))
    if not moe_layers:
        raise ConfigError(f"{path}: no decoder layer of this config is an MoE layer")
    name = config.get("_name_or_path") or config.get("model_type") or "unknown"
    return ModelShape(name=str(name), num_hidden_layers=layers, moe_layers=moe_layers, num_experts=num_experts,
                      top_k=top_k, hidden_size=hidden, expert_bytes=expert_bytes)


def _is_moe_layer(config: dict, layer: int) -> bool:
    first_dense = config.get("first_k_dense_replace")  # DeepSeek
    if isinstance(first_dense, int):
        frequency = config.get("moe_layer_freq") or 1
        return layer >= first_dense and layer % frequency == 0
    if layer in (config.get("mlp_only_layers") or ()):  # Qwen-MoE
        return False
    step = config.get("decoder_sparse_step") or 1
    return (layer + 1) % step == 0
