"""Train the bundled tiny Mixtral from scratch on CPU: `moe-offload train-tiny`.

The recipe (:class:`TinyRecipe`) fixes everything: the seed, the architecture (transformers'
``MixtralForCausalLM``, so the rest of the project treats the result like any downloaded checkpoint), the
data and the schedule. Steps:

1. Text: the CPython standard library's sources (code) and the recovered ShareGPT conversations (English),
   split into training and held-out documents by a hash of their names (moe_offload.text.sources).
2. Tokenizer: a byte-level BPE of ``vocab_size`` tokens trained with `tokenizers` on a sample of the training
   documents of both kinds, so that the embedding matrix stays small.
3. Token streams: documents of each kind in a seeded order, each cut to at most ``max_doc_tokens`` tokens
   (so that a few huge files do not dominate), joined by ``<|endoftext|>`` and cut into windows of
   ``seq_len``; every batch holds as many code windows as English ones.
4. Training: AdamW, linear warm-up then cosine decay, gradient clipping, Mixtral's load-balancing loss
   (``router_aux_loss_coef``) so that no expert dies.
5. Evaluation, on the weights as shipped (rounded to float16): held-out perplexity on code and on English,
   and routing statistics against two random-router controls, the same model with every router's rows
   replaced by seeded Gaussian rows of the same norms (routing that depends on the token, but not learned),
   and token-blind uniform routing: the share of a token's experts that the next token reuses, and the
   total-variation distance between the per-layer expert usage on code and on English.
6. Output: ``config.json``, ``model.safetensors`` (float16), ``tokenizer.json``, ``training-report.json``
   (recipe, data counts, loss curve, metrics, environment) and ``loss-curve.png``.

Bit-for-bit reproduction needs the same PyTorch version and thread count (recorded in the report); CPU
kernels are deterministic for a fixed thread count.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from moe_offload.outputs import atomic_directory, check_output
from moe_offload.version import __version__
from moe_offload.errors import ConfigError
from moe_offload.text.sources import (Document, is_held_out, sharegpt_documents, sharegpt_recovery,
                                      stdlib_documents)

END_OF_TEXT = "<|endoftext|>"


@dataclass(frozen=True)
class TinyRecipe:
    seed: int = 0
    # architecture (MixtralConfig fields)
    vocab_size: int = 4096
    hidden_size: int = 192
    intermediate_size: int = 384
    num_hidden_layers: int = 8
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 1024
    router_aux_loss_coef: float = 0.02
    # data
    seq_len: int = 256
    max_doc_tokens: int = 4096
    tokenizer_sample_chars: int = 6_000_000  # per kind
    # schedule
    steps: int = 1000
    batch_size: int = 16  # windows per step, half code, half English
    learning_rate: float = 2e-3
    min_learning_rate: float = 2e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # evaluation
    eval_windows: int = 64  # per kind

    def mixtral_config(self):
        from transformers import MixtralConfig

        return MixtralConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, num_local_experts=self.num_local_experts,
            num_experts_per_tok=self.num_experts_per_tok, max_position_embeddings=self.max_position_embeddings,
            router_aux_loss_coef=self.router_aux_loss_coef, tie_word_embeddings=True,
            bos_token_id=None, eos_token_id=0, pad_token_id=0, sliding_window=None)


# ----------------------------------------------------------------------------------------------------- data

def _seeded_order(documents: list[Document], seed: int) -> list[Document]:
    return sorted(documents, key=lambda d: hashlib.sha256(f"{seed}:{d.name}".encode()).digest())


@dataclass
class Corpus:
    train: dict[str, list[Document]]     # kind -> documents in seeded order
    held_out: dict[str, list[Document]]
    counts: dict = field(default_factory=dict)


def load_corpus(seed: int) -> Corpus:
    recovery = sharegpt_recovery()
    by_kind = {"code": stdlib_documents(), "english": sharegpt_documents()}
    train = {kind: _seeded_order([d for d in docs if not is_held_out(d.name)], seed) for kind, docs in by_kind.items()}
    held = {kind: _seeded_order([d for d in docs if is_held_out(d.name)], seed) for kind, docs in by_kind.items()}
    counts = {
        "code_source": "the standard library of the Python below (sysconfig stdlib, site-packages excluded)",
        "python": platform.python_version(),
        "code_documents": len(by_kind["code"]),
        "sharegpt_file_bytes": recovery.total_bytes,
        "sharegpt_complete_conversations": len(recovery.conversations),
        "sharegpt_truncated_tail_bytes": recovery.truncated_bytes,
        "english_documents": len(by_kind["english"]),
        "held_out_documents": {kind: len(docs) for kind, docs in held.items()},
        "fingerprint": hashlib.sha256("".join(
            d.name + hashlib.sha256(d.text.encode()).hexdigest() for docs in by_kind.values() for d in docs
        ).encode()).hexdigest(),
    }
    return Corpus(train, held, counts)


def train_tokenizer(corpus: Corpus, recipe: TinyRecipe):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def sample():
        for docs in corpus.train.values():
            taken = 0
            for doc in docs:
                if taken >= recipe.tokenizer_sample_chars:
                    break
                yield doc.text
                taken += len(doc.text)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=recipe.vocab_size, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(sample(), trainer=trainer)
    return tokenizer


def windows(tokenizer, documents: list[Document], count: int, recipe: TinyRecipe) -> np.ndarray:
    """``count`` windows of ``seq_len`` tokens from the documents in order (int64, count x seq_len)."""
    eos = tokenizer.token_to_id(END_OF_TEXT)
    need = count * recipe.seq_len
    stream: list[int] = []
    for doc in documents:
        if len(stream) >= need:
            break
        stream.extend(tokenizer.encode(doc.text).ids[: recipe.max_doc_tokens])
        stream.append(eos)
    if len(stream) < need:
        raise ConfigError(f"the corpus holds only {len(stream)} tokens of this kind; {need} are needed")
    return np.asarray(stream[:need], dtype=np.int64).reshape(count, recipe.seq_len)


# ------------------------------------------------------------------------------------------------- training

def learning_rate(step: int, recipe: TinyRecipe) -> float:
    if step < recipe.warmup_steps:
        return recipe.learning_rate * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return recipe.min_learning_rate + (recipe.learning_rate - recipe.min_learning_rate) * cosine


def perplexity(model, batch: np.ndarray, chunk: int = 16) -> float:
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(batch), chunk):
            ids = torch.from_numpy(batch[start:start + chunk])
            out = model(input_ids=ids, labels=ids)
            n = ids.numel() - ids.shape[0]
            total += float(out.loss) * n
            count += n
    return math.exp(total / count)


def routing_statistics(model, batches: dict[str, np.ndarray], chunk: int = 16) -> dict:
    """Next-token expert reuse and code-vs-English usage distance, from the routers' own logits."""
    import torch

    top_k = model.config.num_experts_per_tok
    num_experts = model.config.num_local_experts
    usage = {}
    reuse_hits, reuse_pairs = 0, 0
    with torch.no_grad():
        for kind, batch in batches.items():
            counts = np.zeros((model.config.num_hidden_layers, num_experts))
            for start in range(0, len(batch), chunk):
                ids = torch.from_numpy(batch[start:start + chunk])
                out = model(input_ids=ids, output_router_logits=True)
                for layer, logits in enumerate(out.router_logits):
                    chosen = logits.topk(top_k, dim=-1).indices.view(ids.shape[0], ids.shape[1], top_k).numpy()
                    np.add.at(counts[layer], chosen.ravel(), 1)
                    one_hot = np.zeros(chosen.shape[:2] + (num_experts,), dtype=bool)
                    np.put_along_axis(one_hot, chosen, True, axis=-1)
                    reuse_hits += int((one_hot[:, 1:] & one_hot[:, :-1]).sum())
                    reuse_pairs += chosen.shape[0] * (chosen.shape[1] - 1) * top_k
            usage[kind] = counts / counts.sum(axis=1, keepdims=True)
    distance = 0.5 * np.abs(usage["code"] - usage["english"]).sum(axis=1)
    return {
        "next_token_expert_reuse": reuse_hits / reuse_pairs,
        "code_english_usage_tv_distance": float(distance.mean()),
        "code_english_usage_tv_distance_per_layer": [round(float(d), 4) for d in distance],
    }


def uniform_routing_statistics(windows: int, seq_len: int, num_layers: int, num_experts: int, top_k: int,
                               seed: int) -> dict:
    """The token-blind control: every token of the same held-out windows gets top_k experts drawn uniformly
    without replacement, so reuse is top_k / num_experts in expectation and the usage distance is sampling
    noise alone."""
    rng = np.random.default_rng(seed)
    usage = {}
    hits = pairs = 0
    for kind in ("code", "english"):
        counts = np.zeros((num_layers, num_experts))
        for layer in range(num_layers):
            chosen = np.argsort(rng.random((windows, seq_len, num_experts)), axis=-1)[..., :top_k]
            np.add.at(counts[layer], chosen.ravel(), 1)
            one_hot = np.zeros((windows, seq_len, num_experts), dtype=bool)
            np.put_along_axis(one_hot, chosen, True, axis=-1)
            hits += int((one_hot[:, 1:] & one_hot[:, :-1]).sum())
            pairs += windows * (seq_len - 1) * top_k
        usage[kind] = counts / counts.sum(axis=1, keepdims=True)
    distance = 0.5 * np.abs(usage["code"] - usage["english"]).sum(axis=1)
    return {"next_token_expert_reuse": hits / pairs, "code_english_usage_tv_distance": float(distance.mean()),
            "code_english_usage_tv_distance_per_layer": [round(float(d), 4) for d in distance]}


def randomize_routers(model, seed: int):
    """The control: every router's rows replaced by seeded Gaussian rows with the trained rows' norms."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            weight = layer.mlp.gate.weight
            random_rows = torch.randn(weight.shape, generator=generator, dtype=torch.float32)
            random_rows *= weight.float().norm(dim=1, keepdim=True) / random_rows.norm(dim=1, keepdim=True)
            weight.copy_(random_rows.to(weight.dtype))
    return model


def train_tiny(out_dir: Path, recipe: TinyRecipe = TinyRecipe(),
               on_step: Callable[[int, float], None] | None = None,
               on_stage: Callable[[str], None] = lambda stage: None) -> dict:
    """Train the tiny model by ``recipe`` and write it to ``out_dir`` (checked first: a new or empty directory;
    written atomically: a failed or interrupted run leaves no partial model); the training report."""
    import torch
    from transformers import MixtralForCausalLM

    # checked before the 40 minutes of work: a new or empty directory in a writable folder
    out_dir = check_output(out_dir, directory=True, what="trained model")
    started = time.perf_counter()
    random.seed(recipe.seed)
    np.random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)

    on_stage("reading the standard library and the ShareGPT conversations")
    corpus = load_corpus(recipe.seed)
    on_stage("training the BPE tokenizer")
    tokenizer = train_tokenizer(corpus, recipe)
    half = recipe.batch_size // 2
    if half * 2 != recipe.batch_size or half == 0:
        raise ConfigError("the batch size must be even: half code, half English")
    on_stage("tokenizing")
    train = {kind: windows(tokenizer, docs, recipe.steps * half, recipe) for kind, docs in corpus.train.items()}
    held = {kind: windows(tokenizer, docs, recipe.eval_windows, recipe) for kind, docs in corpus.held_out.items()}

    config = recipe.mixtral_config()
    model = MixtralForCausalLM(config)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=recipe.learning_rate, betas=(0.9, 0.95))
    losses, aux_losses = [], []
    on_stage("training")
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, recipe)
        rows = slice(step * half, (step + 1) * half)
        ids = torch.from_numpy(np.concatenate([train["code"][rows], train["english"][rows]]))
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        language_loss = out.loss.item() - recipe.router_aux_loss_coef * out.aux_loss.item()
        losses.append(round(language_loss, 5))
        aux_losses.append(round(out.aux_loss.item(), 5))
        if on_step:
            on_step(step, language_loss)
    train_seconds = time.perf_counter() - started

    on_stage("evaluating the float16 weights")
    model.eval()
    model.half().float()  # evaluate exactly the weights that ship
    metrics = {
        "held_out_perplexity": {kind: perplexity(model, batch) for kind, batch in held.items()},
        "routing_trained": routing_statistics(model, held),
    }
    model.half()
    with atomic_directory(out_dir) as staging:  # a failure from here on leaves no partial model behind
        return _write_model(staging, model, tokenizer, recipe, corpus, held, metrics, losses, aux_losses,
                            train_seconds)


def _write_model(out_dir: Path, model, tokenizer, recipe: TinyRecipe, corpus, held, metrics: dict,
                 losses: list[float], aux_losses: list[float], train_seconds: float) -> dict:
    """Write the trained float16 ``model``, its tokenizer, the random-router control's metrics, the training
    report and the loss curve into ``out_dir``; the report."""
    import torch
    from transformers import MixtralForCausalLM, PreTrainedTokenizerFast

    model.save_pretrained(out_dir)
    (out_dir / "generation_config.json").unlink(missing_ok=True)  # greedy by default; nothing to configure
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT,
                                   model_max_length=recipe.max_position_embeddings)
    fast.save_pretrained(out_dir)
    control = randomize_routers(MixtralForCausalLM.from_pretrained(out_dir, dtype=torch.float32), recipe.seed)
    metrics["routing_random_router"] = routing_statistics(control.eval(), held)
    metrics["routing_uniform"] = uniform_routing_statistics(recipe.eval_windows, recipe.seq_len,
                                                            recipe.num_hidden_layers, recipe.num_local_experts,
                                                            recipe.num_experts_per_tok, recipe.seed)
    metrics["held_out_perplexity_random_router"] = {kind: perplexity(control, b) for kind, b in held.items()}
    metrics["uniform_perplexity"] = recipe.vocab_size

    report = {
        "moe_offload_version": __version__,
        "recipe": asdict(recipe),
        "corpus": corpus.counts,
        "tokens_trained": recipe.steps * recipe.batch_size * recipe.seq_len,
        "parameters": sum(p.numel() for p in model.parameters()),
        "loss": losses,
        "aux_loss": aux_losses,
        "metrics": metrics,
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                        "python": platform.python_version(), "machine": platform.machine()},
        "train_seconds": round(train_seconds, 1),
    }
    (out_dir / "training-report.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_loss_curve(losses, out_dir / "loss-curve.png", recipe)
    return report


def plot_loss_curve(losses: list[float], path: Path, recipe: TinyRecipe) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, lw=0.6, alpha=0.4, label="per step")
    window = 25
    if len(losses) >= window:
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1:], smooth, lw=1.5, label=f"mean of {window}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(f"tiny Mixtral, {recipe.num_hidden_layers} layers x {recipe.num_local_experts} experts, "
                 f"{recipe.steps * recipe.batch_size * recipe.seq_len / 1e6:.1f}M tokens", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
