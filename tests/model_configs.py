"""Tiny random configurations of every supported architecture, for adapter, recorder and runtime tests."""

from __future__ import annotations

VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, pad_token_id=0, eos_token_id=0, bos_token_id=None)

SAMPLE_TEXT = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
               "User: what is a cache?\nAssistant: a small fast memory.", "for i in range(10):\n    print(i)\n"]


def tiny_tokenizer():
    """A byte-level BPE of VOCAB tokens (id 0 is end-of-text), like the bundled model's, trained in a blink."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(SAMPLE_TEXT * 4, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def tiny_configs() -> dict:
    """model_type -> (config, MoE decoder-layer indices, experts, top_k, expert intermediate size)."""
    import transformers as tf

    deepseek = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                    n_shared_experts=1, first_k_dense_replace=1, num_key_value_heads=4, intermediate_size=40, moe_intermediate_size=24,
                    num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2)
    return {
        "mixtral": (tf.MixtralConfig(**COMMON, intermediate_size=48, num_hidden_layers=3, num_local_experts=6,
                                     num_experts_per_tok=2), [0, 1, 2], 6, 2, 48),
        "olmoe": (tf.OlmoeConfig(**COMMON, intermediate_size=48, num_hidden_layers=2, num_experts=8,
                                 num_experts_per_tok=3), [0, 1], 8, 3, 48),
        "qwen2_moe": (tf.Qwen2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=24,
                                        shared_expert_intermediate_size=40, num_hidden_layers=3, num_experts=6,
                                        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
                                        norm_topk_prob=False), [0, 2], 6, 2, 24),
        "qwen3_moe": (tf.Qwen3MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=24, head_dim=8,
                                        num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                                        norm_topk_prob=True), [0, 1], 8, 2, 24),
        "deepseek_v2": (tf.DeepseekV2Config(**{**COMMON, **deepseek}, topk_method="greedy", n_group=1, topk_group=1),
                        [1, 2], 8, 2, 24),
        "deepseek_v3": (tf.DeepseekV3Config(**{**COMMON, **deepseek}, n_group=2, topk_group=1, norm_topk_prob=True),
                        [1, 2], 8, 2, 24),
    }


def build(model_type: str, seed: int = 0):
    """A randomly initialised model of the architecture, in float32, eval mode, with its adapter."""
    import torch
    import transformers as tf

    from moe_offload.models.adapters import ARCHITECTURES, MoeAdapter

    config = tiny_configs()[model_type][0]
    torch.manual_seed(seed)
    model = getattr(tf, ARCHITECTURES[model_type].causal_lm)(config).eval()
    with torch.no_grad():  # routers start at zero in some architectures: give them something to route by
        for parameter in model.parameters():
            if parameter.abs().sum() == 0 and parameter.dim() == 2:
                parameter.normal_(0, 0.5)
    model.set_experts_implementation("eager")
    return model, MoeAdapter(model)
