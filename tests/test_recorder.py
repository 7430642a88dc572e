"""The recorder: what it writes per token, checked against the model computed independently, and that it
never changes what the model generates."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from model_configs import build, tiny_tokenizer  # noqa: E402

from moe_offload.cli.main import main  # noqa: E402
from moe_offload.models.recorder import record  # noqa: E402
from moe_offload.text.prompts import Prompt  # noqa: E402
from moe_offload.trace.format import DECODE, PREFILL, read_trace, write_trace  # noqa: E402

PROMPTS = [Prompt("def add(a, b):", "t:0"), Prompt("The quick brown fox jumps over", "t:1"),
           Prompt("User: what is a cache?\nAssistant:", "t:2")]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_recording_does_not_change_generation(model_type, tokenizer):
    model, adapter = build(model_type)
    kwargs = dict(model_name=model_type, max_new_tokens=6, batch_size=2)
    with_tap = record(model, adapter, tokenizer, PROMPTS, **kwargs)
    without = record(model, adapter, tokenizer, PROMPTS, tap=False, **kwargs)
    assert with_tap.generated == without.generated
    assert with_tap.texts == without.texts


def test_rows_iterations_and_columns(tokenizer):
    model, adapter = build("mixtral")
    rec = record(model, adapter, tokenizer, PROMPTS, model_name="m", max_new_tokens=5, batch_size=2)
    trace = rec.trace
    lengths = [len(tokenizer(p.text)["input_ids"]) for p in PROMPTS]
    decode_rows = [max(0, len(g) - 1) for g in rec.generated]
    assert trace.num_tokens == sum(lengths) + sum(decode_rows)
    for request, (n, d) in enumerate(zip(lengths, decode_rows)):
        rows = trace.request == request
        assert (trace.phase[rows] == PREFILL).sum() == n and (trace.phase[rows] == DECODE).sum() == d
        assert trace.position[rows].tolist() == list(range(n + d))
    # batch 0 (requests 0, 1): prefill iteration 0, decode 1..4; batch 1 (request 2) starts at 5
    assert set(trace.iteration[(trace.request == 0) & (trace.phase == PREFILL)]) == {0}
    assert set(trace.iteration[(trace.request == 2) & (trace.phase == PREFILL)]) == {5}
    assert np.all(np.diff(trace.iteration) >= 0)
    probs = trace.probs.astype(np.float32)
    np.testing.assert_allclose(probs.sum(axis=2), 1.0, atol=5e-3)
    top = np.sort(np.argsort(-probs, axis=2, kind="stable")[:, :, :2], axis=2)
    assert (np.sort(trace.experts, axis=2) == top).mean() > 0.99  # float16 ties aside, experts are the top-2
    assert np.all(trace.weights[:, :, 0] >= trace.weights[:, :, 1])  # rank order
    assert trace.gate_prediction.shape == (trace.num_tokens, adapter.num_layers - 1, adapter.num_experts)
    meta = trace.meta
    assert meta.extra["model_config"]["model_type"] == "mixtral"
    assert [r["source"] for r in meta.extra["recorder"]["requests"]] == ["t:0", "t:1", "t:2"]


def test_every_row_matches_an_independent_forward(tokenizer):
    """Experts, probabilities, embedding and both gate predictions of every row of one request, prefill and
    decode, recomputed by one forward over the tokens the rows fed the model (prompt, then all generated
    tokens but the last)."""
    model, adapter = build("mixtral")
    prompt = PROMPTS[1]
    rec = record(model, adapter, tokenizer, [prompt], model_name="m", max_new_tokens=4, batch_size=1)
    trace = rec.trace
    ids = tokenizer(prompt.text, return_tensors="pt")["input_ids"]
    fed = torch.cat([ids, torch.tensor([rec.generated[0][:-1]])], dim=1)
    assert trace.num_tokens == fed.shape[1] and (trace.phase == DECODE).sum() == len(rec.generated[0]) - 1
    attention_out = {}
    hooks = [model.model.layers[i].self_attn.register_forward_hook(
        lambda module, args, out, i=i: attention_out.__setitem__(i, out[0])) for i in range(adapter.num_layers)]
    L = adapter.num_layers
    with torch.no_grad():
        out = model(input_ids=fed, output_hidden_states=True)
        for hook in hooks:
            hook.remove()
        post_attention = [out.hidden_states[layer] + attention_out[layer] for layer in range(L)]  # residual stream

        def router(layer, hidden):  # router ``layer`` through its own norm
            following = model.model.layers[layer]
            return (following.post_attention_layernorm(hidden)[0] @ following.mlp.gate.weight.T).softmax(-1).numpy()

        for layer in range(L):
            probs = router(layer, post_attention[layer])
            np.testing.assert_allclose(trace.probs[:, layer].astype(np.float32), probs, atol=2e-3)
            assert (np.sort(trace.experts[:, layer], axis=1) == np.sort(np.argsort(-probs, 1)[:, :2], axis=1)).all()
            if layer + 1 < L:
                np.testing.assert_allclose(trace.gate_prediction[:, layer].astype(np.float32),
                                           router(layer + 1, post_attention[layer]), atol=2e-3)
        # paper 004 (after AdapMoE): layer 0 of the next token from this token's last layer
        np.testing.assert_allclose(trace.next_token_gate_prediction.astype(np.float32),
                                   router(0, post_attention[L - 1]), atol=2e-3)
        embedding = model.get_input_embeddings()(fed)[0].numpy()
    # paper 000: a semantic embedding per inference iteration, from the embedding layer's output: each row holds
    # its own token's, so it changes along the request (the prompt's mean would repeat on every row)
    np.testing.assert_allclose(trace.embedding.astype(np.float32), embedding, atol=2e-3)
    decode = trace.embedding[trace.phase == DECODE].astype(np.float32)
    assert len(decode) >= 2 and not np.allclose(decode[0], decode[1])
    assert trace.meta.embedding_kind == "token"


def test_trace_round_trips_and_feeds_every_prefetcher(tokenizer, tmp_path):
    from moe_offload.prefetch import PREFETCHERS
    from moe_offload.prefetch.requirements import check_trace_columns

    model, adapter = build("olmoe")
    trace = record(model, adapter, tokenizer, PROMPTS, model_name="m", max_new_tokens=4, batch_size=3).trace
    back = read_trace(write_trace(trace, tmp_path / "t.parquet"))
    assert np.array_equal(back.experts, trace.experts) and np.array_equal(back.probs, trace.probs)
    for prefetcher in PREFETCHERS.values():
        check_trace_columns(prefetcher, back)  # raises when a prefetcher's column is missing


def test_record_cli_errors(tmp_path, capsys):
    assert main(["record", "--model", str(tmp_path / "nope"), "--prompts", "humaneval", "--limit", "1",
                 "-o", str(tmp_path / "t.parquet")]) == 2
    assert "no such model directory" in capsys.readouterr().err
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["record", "--model", str(tmp_path / "model"), "--prompts", "humaneval", "--limit", "1",
                 "-o", str(tmp_path / "t.parquet")]) == 2
    assert "not supported" in capsys.readouterr().err
    assert main(["record", "--prompts", str(tmp_path / "missing.txt"), "-o", str(tmp_path / "t.parquet")]) == 2
    assert "no such prompt file" in capsys.readouterr().err
