"""What the project needs to know about a Hugging Face MoE model, for every supported architecture.

transformers 5.x builds Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3 the same way: decoder layers
at ``model.model.layers``, each with a ``post_attention_layernorm`` and an ``mlp``; in an MoE layer the
``mlp`` holds a router ``gate`` (returning logits, top-k weights, top-k indices) and an ``experts`` module
whose weights are fused 3-D tensors, ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], and whose
forward dispatches to an implementation registered in ``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``.

What differs between the architectures is data, in :data:`ARCHITECTURES`: how the router turns logits into
scores (softmax or sigmoid), whether the top-k weights are renormalised, which modules are shared experts
(always resident, never offloaded). Counts and sizes are read from the modules themselves, so a config
field with another name (``num_local_experts``, ``num_experts``, ``n_routed_experts``) never matters, and
dense layers (DeepSeek's first k, Qwen's ``mlp_only_layers``) are simply layers without ``experts``.

MoE layers are numbered 0..L-1 in the order they appear, which is the numbering of traces and caches; the
decoder-layer index of MoE layer l is ``adapter.decoder_layers[l]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moe_offload.errors import ConfigError
from moe_offload.models import quiet_transformers
from moe_offload.policies.base import ModelSpec


@dataclass(frozen=True)
class ArchitectureSpec:
    model_type: str             # config.model_type
    causal_lm: str              # the transformers class that loads it
    router_scoring: str         # "softmax" or "sigmoid": how the router's logits become expert scores
    top_k_normalised: str       # "always", "never", or the config field that decides (norm_topk_prob)
    shared_experts: tuple[str, ...] = ()  # mlp submodules that run for every token (resident, not offloaded)


ARCHITECTURES: dict[str, ArchitectureSpec] = {spec.model_type: spec for spec in (
    ArchitectureSpec("mixtral", "MixtralForCausalLM", "softmax", "always"),
    ArchitectureSpec("olmoe", "OlmoeForCausalLM", "softmax", "norm_topk_prob"),
    ArchitectureSpec("qwen2_moe", "Qwen2MoeForCausalLM", "softmax", "norm_topk_prob",
                     ("shared_expert", "shared_expert_gate")),
    ArchitectureSpec("qwen3_moe", "Qwen3MoeForCausalLM", "softmax", "norm_topk_prob"),
    ArchitectureSpec("deepseek_v2", "DeepseekV2ForCausalLM", "softmax", "never", ("shared_experts",)),
    ArchitectureSpec("deepseek_v3", "DeepseekV3ForCausalLM", "sigmoid", "norm_topk_prob", ("shared_experts",)),
)}


def refuse_missing_tensors(loading: dict, lacking: str) -> None:
    """ConfigError "``lacking`` the tensor for NAME [and N more]" when ``loading`` (from_pretrained's
    output_loading_info) has missing keys: transformers fills a tensor its source lacks with random values,
    which would be another model, not an error."""
    missing = sorted(loading["missing_keys"])
    if missing:
        raise ConfigError(f"{lacking} the tensor for {missing[0]}"
                          + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))


def architecture_of(config) -> ArchitectureSpec:
    spec = ARCHITECTURES.get(getattr(config, "model_type", None))
    if spec is None:
        raise ConfigError(f"model type {getattr(config, 'model_type', None)!r} is not supported; supported: "
                          f"{', '.join(sorted(ARCHITECTURES))}")
    return spec


class MoeAdapter:
    """A loaded transformers MoE model seen through the project's seams: layers, experts, bytes, routers."""

    def __init__(self, model, stored_dtype: str | None = None):
        self.model = model
        self.stored_dtype = stored_dtype  # the checkpoint's dtype on disk ("float16"), when known
        self.config = model.config
        self.spec = architecture_of(self.config)
        decoder = getattr(getattr(model, "model", None), "layers", None)
        if decoder is None:
            raise ConfigError(f"{type(model).__name__} has no model.layers: not a decoder-only MoE model")
        self.decoder_layers = [i for i, layer in enumerate(decoder) if hasattr(getattr(layer, "mlp", None), "experts")]
        if not self.decoder_layers:
            raise ConfigError(f"{type(model).__name__} has no MoE layer (no mlp.experts module)")
        self._decoder = decoder
        first = self.experts(0)
        layout = {name: getattr(first, name, default) for name, default in
                  (("has_gate", True), ("is_concatenated", True), ("is_transposed", False), ("has_bias", False))}
        if layout != {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False}:
            raise ConfigError(f"{type(first).__name__}: expert layout {layout} is not supported (fused gate_up_proj "
                              "[E, 2I, H] and down_proj [E, H, I] without bias)")
        self.num_experts = int(first.num_experts)
        self.hidden_size = int(first.hidden_dim)
        self.intermediate_size = int(first.intermediate_dim)
        self.top_k = int(self.config.num_experts_per_tok)
        if not 0 < self.top_k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.top_k} is not within 1..{self.num_experts}")

    # --------------------------------------------------------------------------------------------- structure
    @property
    def num_layers(self) -> int:
        return len(self.decoder_layers)

    def decoder_layer(self, layer: int):
        return self._decoder[self.decoder_layers[layer]]

    def experts(self, layer: int):
        return self.decoder_layer(layer).mlp.experts

    def router(self, layer: int):
        return self.decoder_layer(layer).mlp.gate

    def router_norm(self, layer: int):
        """The norm whose output the router of ``layer`` reads."""
        return self.decoder_layer(layer).post_attention_layernorm

    @property
    def top_k_normalised(self) -> bool:
        rule = self.spec.top_k_normalised
        return rule == "always" or (rule != "never" and bool(getattr(self.config, rule, False)))

    # ----------------------------------------------------------------------------------------------- experts
    EXPERT_TENSORS = ("gate_up_proj", "down_proj")

    def expert_tensors(self, layer: int, expert: int) -> dict:
        """The weights of one routed expert, as views into the fused tensors (name -> tensor)."""
        module = self.experts(layer)
        return {name: getattr(module, name)[expert] for name in self.EXPERT_TENSORS}

    def expert_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.expert_tensors(0, 0).values())

    def stored_expert_bytes(self) -> int:
        """Bytes of one expert in the checkpoint's own dtype, whatever it was loaded as."""
        import torch

        stored = getattr(torch, self.stored_dtype, None) if self.stored_dtype else None
        if not isinstance(stored, torch.dtype):
            return self.expert_bytes()
        return sum(t.numel() for t in self.expert_tensors(0, 0).values()) * stored.itemsize

    def total_expert_bytes(self) -> int:
        return self.expert_bytes() * self.num_layers * self.num_experts

    def model_spec(self) -> ModelSpec:
        return ModelSpec(num_layers=self.num_layers, num_experts=self.num_experts, top_k=self.top_k)

    # ------------------------------------------------------------------------------------------------ routers
    def scores(self, router_logits):
        """The router's score of every expert from its logits, as the architecture defines it."""
        logits = router_logits.float()
        return logits.sigmoid() if self.spec.router_scoring == "sigmoid" else logits.softmax(dim=-1)

    def probabilities(self, router_logits):
        """The router's distribution over experts (scores normalised to sum to 1): fMoE's expert map."""
        scores = self.scores(router_logits)
        return scores / scores.sum(dim=-1, keepdim=True)

    def predict_next_router_logits(self, layer: int, hidden_before_norm):
        """MoEpic's speculative gate: the next router in pass order applied to layer ``layer``'s post-attention
        hidden state, normalised by that router's own norm (the input it expects): router ``layer+1``, or for
        the last layer router 0, which predicts layer 0 of the next token (AdapMoE's rule in paper 004)."""
        import torch.nn.functional as F

        following = (layer + 1) % self.num_layers
        normed = self.router_norm(following)(hidden_before_norm)
        weight = self.router(following).weight
        return F.linear(normed.reshape(-1, normed.shape[-1]).float(), weight.float())

    def describe(self) -> dict:
        """The model's identity for a trace's metadata."""
        return {"model_type": self.spec.model_type, "num_layers": self.num_layers, "num_experts": self.num_experts,
                "top_k": self.top_k, "hidden_size": self.hidden_size, "expert_bytes": self.expert_bytes(),
                "router_scoring": self.spec.router_scoring, "top_k_normalised": self.top_k_normalised,
                "decoder_layers": self.decoder_layers, "config": json.loads(self.config.to_json_string())}


def read_config(directory: str | Path):
    """The checkpoint's config, with an error naming the file when it is missing or not a supported MoE."""
    from transformers import AutoConfig

    directory = Path(directory)
    config_file = directory / "config.json"
    if not directory.is_dir():
        raise ConfigError(f"{directory}: no such model directory")
    if not config_file.is_file():
        raise ConfigError(f"{config_file}: missing (a model directory needs config.json)")
    try:
        config = AutoConfig.from_pretrained(directory)
    except (ValueError, OSError, json.JSONDecodeError, KeyError) as exc:
        raise ConfigError(f"{config_file}: cannot be read as a transformers config: {exc}") from None
    architecture_of(config)
    return config


def load_model(directory: str | Path, dtype=None, experts_implementation: str = "eager"):
    """Load a local checkpoint with transformers and return (model, adapter); errors name the file."""
    import torch
    import transformers

    quiet_transformers()
    config = read_config(directory)
    spec = architecture_of(config)
    model_class = getattr(transformers, spec.causal_lm)
    weights = sorted(Path(directory).glob("*.safetensors")) + sorted(Path(directory).glob("*.bin"))
    if not weights:
        raise ConfigError(f"{directory}: no weight file (*.safetensors) in the model directory")
    from safetensors import SafetensorError

    try:
        model, loading = model_class.from_pretrained(directory, dtype=dtype or torch.float32,
                                                     experts_implementation=experts_implementation,
                                                     output_loading_info=True)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:  # a truncated file: SafetensorError
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise ConfigError(f"{directory}: the checkpoint cannot be loaded: {lines[0]}") from None
    refuse_missing_tensors(loading, f"{directory}: the weight files lack")
    model.eval()
    raw = json.loads((Path(directory) / "config.json").read_text())
    return model, MoeAdapter(model, stored_dtype=raw.get("dtype") or raw.get("torch_dtype"))
