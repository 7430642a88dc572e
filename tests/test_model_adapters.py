"""The adapter of every supported architecture, on tiny random configurations: counts, bytes, and the
registered experts function against transformers' own forward."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from model_configs import build, tiny_configs  # noqa: E402

from moe_offload.errors import ConfigError  # noqa: E402
from moe_offload.models.adapters import ARCHITECTURES, MoeAdapter  # noqa: E402
from moe_offload.models.experts import use_project_experts  # noqa: E402

MODEL_TYPES = sorted(ARCHITECTURES)


def test_every_architecture_has_a_test_config():
    assert sorted(tiny_configs()) == MODEL_TYPES


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_counts_and_bytes(model_type):
    _, decoder_layers, experts, top_k, intermediate = tiny_configs()[model_type]
    model, adapter = build(model_type)
    assert adapter.decoder_layers == decoder_layers
    assert (adapter.num_layers, adapter.num_experts, adapter.top_k) == (len(decoder_layers), experts, top_k)
    hidden = 32
    assert adapter.expert_bytes() == (2 * intermediate * hidden + hidden * intermediate) * 4  # float32
    assert adapter.total_expert_bytes() == adapter.expert_bytes() * len(decoder_layers) * experts
    tensors = adapter.expert_tensors(adapter.num_layers - 1, experts - 1)
    assert tensors["gate_up_proj"].shape == (2 * intermediate, hidden)
    assert tensors["down_proj"].shape == (hidden, intermediate)
    spec = adapter.model_spec()
    assert (spec.num_layers, spec.num_experts, spec.top_k) == (len(decoder_layers), experts, top_k)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


class ReversingSource:
    """An expert source handing out copies of the weights in descending order (the order of arrival must not
    matter), recording what each layer asked for and that every generator was closed."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.calls = []

    def layer_experts(self, layer, experts, tokens):
        self.calls.append(("begin", layer, tuple(experts)))
        try:
            for expert in reversed(experts):
                yield expert, {name: t.clone() for name, t in self.adapter.expert_tensors(layer, expert).items()}
        finally:
            self.calls.append(("end", layer))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_registered_experts_function_reproduces_eager_exactly(model_type):
    model, adapter = build(model_type)
    ids = torch.randint(2, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    eager = _logits(model, ids)
    use_project_experts(adapter)
    assert torch.equal(_logits(model, ids), eager)
    source = ReversingSource(adapter)
    use_project_experts(adapter, source)
    assert torch.equal(_logits(model, ids), eager)
    assert len([c for c in source.calls if c[0] == "end"]) == len([c for c in source.calls if c[0] == "begin"])
    begins = [call for call in source.calls if call[0] == "begin"]
    assert [layer for _, layer, _ in begins] == list(range(adapter.num_layers))
    for _, layer, experts in begins:
        assert list(experts) == sorted(set(experts)) and len(experts) >= adapter.top_k
    model.set_experts_implementation("grouped_mm")  # transformers' default: the same up to rounding
    torch.testing.assert_close(_logits(model, ids), eager, rtol=1e-4, atol=1e-4)


def test_sigmoid_and_softmax_scoring():
    _, softmax_adapter = build("mixtral")
    _, sigmoid_adapter = build("deepseek_v3")
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0, 0.5, 0.1, 0.2, 0.3]])
    assert torch.allclose(softmax_adapter.probabilities(logits[:, :6]).sum(), torch.tensor(1.0))
    assert torch.allclose(sigmoid_adapter.scores(logits), logits.sigmoid())
    probs = sigmoid_adapter.probabilities(logits)
    assert torch.allclose(probs, logits.sigmoid() / logits.sigmoid().sum())


def test_normalisation_rule_is_data():
    _, qwen2 = build("qwen2_moe")
    _, qwen3 = build("qwen3_moe")
    _, mixtral = build("mixtral")
    _, deepseek = build("deepseek_v2")
    assert (qwen2.top_k_normalised, qwen3.top_k_normalised, mixtral.top_k_normalised, deepseek.top_k_normalised) \
        == (False, True, True, False)


def test_unsupported_model_is_refused():
    import transformers as tf

    dense = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ConfigError, match="not supported"):
        MoeAdapter(dense)
