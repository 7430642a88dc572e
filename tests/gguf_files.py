"""Small GGUF checkpoints written as llama.cpp's convert_hf_to_gguf.py writes them, for tests/test_gguf.py and
benchmarks/gguf_pack.py: a random-weight Qwen3-MoE (or Qwen2-MoE) built with transformers, its tensors renamed
by the ``gguf`` package's own ``TensorNameMap`` (``blk.N.ffn_gate_exps`` ...), each layer's experts as the 3-D
tensors convert_hf_to_gguf stacks them into ([E, I, H] gate and up, [E, H, I] down), the bundled tokenizer's
byte-level BPE vocabulary and merges as the ``gpt2`` tokenizer model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moe_offload.bundled import TINY_MODEL_DIR

# rms_norm_eps as float32 holds it: the GGUF stores a float32, so both checkpoints get the same config
EPS = float(np.float32(1e-6))
SHAPE = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
             max_position_embeddings=256)


def tiny_qwen3_moe(seed: int = 0):
    """A random-weight Qwen3-MoE small enough to write in a test (float32, untied LM head)."""
    import transformers

    config = transformers.Qwen3MoeConfig(**SHAPE, norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=EPS,
                                         rope_theta=1e6, eos_token_id=0, pad_token_id=0)
    return _random(transformers.Qwen3MoeForCausalLM, config, seed)


def tiny_qwen2_moe(seed: int = 0):
    """A random-weight Qwen2-MoE (shared expert, attention biases; no head_dim of its own, as GGUF has none)."""
    import transformers

    shape = {key: value for key, value in SHAPE.items() if key != "head_dim"}
    config = transformers.Qwen2MoeConfig(**shape, shared_expert_intermediate_size=48, norm_topk_prob=False,
                                         tie_word_embeddings=False, rms_norm_eps=EPS, rope_theta=1e6,
                                         eos_token_id=0, pad_token_id=0)
    return _random(transformers.Qwen2MoeForCausalLM, config, seed)


def _random(model_class, config, seed: int):
    import torch

    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # transformers initialises norms to 1: random ones test that they travel
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    return model


def save_checkpoint(model, directory: Path, gguf_file: Path) -> Path:
    """The model as a safetensors checkpoint with the tokenizer transformers reads from ``gguf_file``: the
    bundled byte-level BPE comes back from GGUF as a Qwen2Tokenizer, whose own pre-tokenizer splits digits
    apart, so the bundled tokenizer.json itself would tokenize some prompts differently."""
    from transformers import AutoTokenizer

    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).save_pretrained(directory)
    return directory


def write_gguf(model, path: Path, quantization: str | None = None, architecture: str | None = None,
               expert_count: int | None = None, split_count: int | None = None, metadata: dict | None = None) -> Path:
    """``model`` as a GGUF file. ``quantization`` ``"Q8_0"``: every matrix whose rows are whole Q8_0 blocks is
    stored quantized by the gguf package's own quantizer (norms stay F32, as llama.cpp keeps them); else F32.
    ``architecture``, ``expert_count`` and ``split_count`` (the first shard of that many, as llama-gguf-split
    marks it) write other metadata over the same tensors (for the refusals); ``metadata`` maps keys to
    (value, GGUFValueType) written over (or beside) the others: a field of the wrong type or size."""
    import gguf

    config = model.config
    written = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}[config.model_type]
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == written)
    names = gguf.TensorNameMap(arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, architecture or written)
    if split_count:
        writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, 0)
        writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, split_count)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if config.model_type == "qwen3_moe":  # Qwen2-MoE's head size is hidden / heads, and GGUF says nothing
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(expert_count or config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.model_type == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    tokenizer = json.loads((TINY_MODEL_DIR / "tokenizer.json").read_text())
    vocabulary = sorted(tokenizer["model"]["vocab"], key=tokenizer["model"]["vocab"].get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocabulary)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(vocabulary))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_eos_token_id(0)
    writer.add_pad_token_id(0)
    for name, tensor in gguf_tensors(model, names):
        data = tensor.detach().numpy().astype(np.float32)
        if quantization == "Q8_0" and data.ndim >= 2 and data.shape[-1] % 32 == 0:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    for key, (value, kind) in (metadata or {}).items():
        writer.kv_data[0][key] = gguf.gguf_writer.GGUFValue(value, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_tensors(model, names):
    """(GGUF name, tensor) of every weight: transformers' fused gate_up_proj [E, 2I, H] is split into the
    gate and up halves convert_hf_to_gguf writes as ``ffn_gate_exps`` and ``ffn_up_exps``."""
    for name, tensor in model.state_dict().items():
        if ".mlp.experts." in name:
            prefix, tensor_name = name.rsplit(".", 1)
            halves = {"down_proj": tensor} if tensor_name == "down_proj" else \
                dict(zip(("gate_proj", "up_proj"), tensor.chunk(2, dim=1)))
            for part, half in halves.items():
                yield f"{names.get_name(f'{prefix}.{part}')}.weight", half.contiguous()
            continue
        base, suffix = name.rsplit(".", 1)
        if base.endswith("shared_expert_gate"):  # [1, H] in transformers, a vector {H} in llama.cpp
            tensor = tensor.reshape(-1)
        yield f"{names.get_name(base)}.{suffix}", tensor


def q8_0_values(blocks: np.ndarray) -> np.ndarray:
    """Q8_0 blocks by hand (ggml's block_q8_0: a float16 scale d, then 32 int8 q; the value is d * q), as the
    float32 tensor they stand for: independent of the dequantizers of gguf and transformers."""
    rows = blocks.reshape(-1, 34)
    scales = rows[:, :2].copy().view(np.float16).astype(np.float32)
    values = rows[:, 2:].copy().view(np.int8).astype(np.float32)
    return (scales * values).reshape(*blocks.shape[:-1], blocks.shape[-1] // 34 * 32)


def header_only_gguf(path: Path, value_type: int, value: bytes, size: int = 4096) -> Path:
    """A GGUF file of ``size`` bytes whose header holds no tensor and one key ``hostile`` of GGUF type
    ``value_type`` with the raw bytes ``value`` (laid out as ggml/include/gguf.h describes), the rest zeros:
    for declared counts the file cannot hold (an array of 2^40 entries)."""
    import struct

    key = b"hostile"
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    header += struct.pack("<I", value_type) + value
    path.write_bytes(header + bytes(max(0, size - len(header))))
    return path
