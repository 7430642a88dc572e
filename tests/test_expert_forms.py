"""How the fast tier holds quantized experts (runtime/expert_forms.py): PyTorch's weight-only int4 kernel fed from
the pack's bytes against hand-worked products and the dequantized weights, the bytes a slot takes in each form,
the choice ``auto`` makes, and generation lossless in every form against the all-resident engine in that form,
with bypassed experts computed on the host from the host tier's stored copy."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from model_configs import COMMON, tiny_tokenizer  # noqa: E402
from test_runtime import NEW_TOKENS, PROMPTS  # noqa: E402
from test_runtime_bypass import OddLayersOnHost  # noqa: E402

from moe_offload.cli.main import main  # noqa: E402
from moe_offload.errors import ConfigError  # noqa: E402
from moe_offload.policies import POLICIES, PolicyInfo  # noqa: E402
from moe_offload.plan import make_plan  # noqa: E402
from moe_offload.runtime.engine import OffloadEngine  # noqa: E402
from moe_offload.runtime.expert_forms import expert_form  # noqa: E402
from moe_offload.models.experts import linear  # noqa: E402
from moe_offload.runtime.int4_kernel import convert, kernel_nbytes, kernel_tensors, kernel_takes  # noqa: E402
from moe_offload.runtime.packing import pack_model, read_manifest  # noqa: E402
from moe_offload.runtime.quantize import dequantize, quantize  # noqa: E402
from waits import RESULT_WAIT_S  # noqa: E402

HIDDEN, INTERMEDIATE = 64, 64  # every weight in groups of 64, rows in multiples of 16: the kernel takes them


def kernel_weight(weight, dtype):
    """The int4 kernel's form of ``weight`` as the fast tier makes it on arrival."""
    stored = quantize(weight, "int4")
    shape = tuple(weight.shape)
    region = torch.empty(kernel_nbytes([shape], dtype.itemsize), dtype=torch.uint8)
    convert({"w": (stored, shape)}, region, dtype)
    return kernel_tensors(region, {"w": shape}, dtype)["w"], stored


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_computes_the_stored_weights_exactly_where_every_number_is_representable(dtype):
    # a row of 32 columns whose group maximum is 7: scale 1, codes q = W; powers of two keep every sum exact
    weight = torch.zeros(16, 32)
    weight[0, :8] = torch.tensor([7.0, -7.0, 1.0, 0.0, 2.0, -3.0, 4.0, 5.0])
    weight[1] = 7.0
    x = torch.zeros(1, 32)
    x[0, :8] = torch.tensor([1.0, 1.0, 2.0, 100.0, 0.5, 1.0, -1.0, 0.25])
    packed, _ = kernel_weight(weight, dtype)
    out = linear(x.to(dtype), packed)
    # row 0: 7 - 7 + 2 + 0 + 1 - 3 - 4 + 1.25 = -2.75; row 1: 7 x (1 + 1 + 2 + 100 + 0.5 + 1 - 1 + 0.25) = 733.25,
    # which bfloat16 rounds to 732 (its step is 4 between 512 and 1024)
    assert out.dtype == dtype and out.shape == (1, 16)
    assert out[0, 0].item() == -2.75 and out[0, 1].item() == (733.25 if dtype == torch.float32 else 732.0)
    assert out[0, 2:].eq(0).all()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_kernel_is_the_product_with_the_dequantized_weights_within_rounding(dtype, tolerance):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(128, 192, generator=generator)
    x = torch.randn(5, 192, generator=generator)
    packed, stored = kernel_weight(weight, dtype)
    expected = x @ dequantize(stored, weight.shape, "int4", torch.float32).t()
    got = linear(x.to(dtype), packed).float()
    assert (got - expected).abs().max().item() <= tolerance * expected.abs().max().item()


def test_the_kernel_takes_any_rows_as_f_linear_does():
    packed, _ = kernel_weight(torch.randn(64, 64, generator=torch.Generator().manual_seed(1)), torch.bfloat16)
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    rows = x.t().contiguous()
    assert torch.equal(linear(x.t(), packed), linear(rows, packed))  # a transposed view: copied, same bits
    assert torch.equal(linear(rows.reshape(2, 3, 64), packed), linear(rows, packed).reshape(2, 3, 64))


def test_the_kernel_takes_groups_of_32_to_256_and_rows_in_sixteens():
    assert kernel_takes([(768, 192), (192, 384)])      # the bundled model: groups of 64
    assert not kernel_takes([(96, 32), (32, 48)])      # the runtime tests' model: down's groups of 16
    assert not kernel_takes([(100, 64)])               # 100 rows are not tiles of 16


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """A tiny random Mixtral (3 layers x 6 experts, top-2) whose experts the kernel takes, packed int4 and int8."""
    import transformers as tf

    root = tmp_path_factory.mktemp("forms")
    config = tf.MixtralConfig(**{**COMMON, "hidden_size": HIDDEN}, intermediate_size=INTERMEDIATE,
                              num_hidden_layers=3, num_local_experts=6, num_experts_per_tok=2)
    torch.manual_seed(5)
    tf.MixtralForCausalLM(config).half().save_pretrained(root / "model")
    tiny_tokenizer().save_pretrained(root / "model")
    out = {}
    for expert_dtype in ("int4", "int8"):
        pack_model(root / "model", root / expert_dtype, expert_dtype=expert_dtype)
        out[expert_dtype] = root / expert_dtype
    return out


# per expert: gate_up [128, 64], down [64, 64]; 12288 weights, 192 groups of 64
WEIGHTS, GROUPS = 2 * INTERMEDIATE * HIDDEN + HIDDEN * INTERMEDIATE, (2 * INTERMEDIATE + HIDDEN) * HIDDEN // 64


@pytest.mark.parametrize("expert_dtype, choice, dtype, form, slot_bytes", [
    ("int4", "per-use", "float32", "per-use", WEIGHTS // 2 + GROUPS * 2),        # the stored bytes: 6528
    ("int4", "kernel", "bfloat16", "kernel", WEIGHTS // 2 + GROUPS * 2 * 2),     # scale and zero in bf16: 6912
    ("int4", "kernel", "float32", "kernel", WEIGHTS // 2 + GROUPS * 2 * 4),      # in float32: 7680
    ("int8", "on-arrival", "float32", "on-arrival", WEIGHTS * 4),                 # float32 weights: 49152
    ("int4", None, "bfloat16", "kernel", WEIGHTS // 2 + GROUPS * 2 * 2),         # auto: the kernel in bf16
    ("int4", "auto", "float32", "per-use", WEIGHTS // 2 + GROUPS * 2),           # auto: not in float32
    ("int4", "auto", "float16", "per-use", WEIGHTS // 2 + GROUPS * 2),           # nor float16 (scalar loops)
    ("int8", None, "bfloat16", "per-use", WEIGHTS + GROUPS * 2),                 # no int8 kernel here
])
def test_each_form_takes_the_bytes_its_slot_holds(packs, expert_dtype, choice, dtype, form, slot_bytes):
    manifest = read_manifest(packs[expert_dtype])
    chosen = expert_form(choice, manifest, torch.device("cpu"), getattr(torch, dtype))
    assert (chosen.name, chosen.slot_bytes) == (form, slot_bytes)
    with OffloadEngine(make_plan(packs[expert_dtype], fast_budget=f"{3 * slot_bytes}B", dtype=dtype, expert_compute=choice,
                                 device="cpu")) as engine:
        assert engine.tiers[0].pool.slots == 3 and engine.tiers[0].slot_bytes == slot_bytes


def test_a_form_that_cannot_run_is_one_line_before_any_work(packs, checkpoint_packed, capsys):
    with pytest.raises(ConfigError, match="the weight-only kernel takes int4 experts, not int8"):
        OffloadEngine(make_plan(packs["int8"], expert_compute="kernel", device="cpu"))
    with pytest.raises(ConfigError, match=r"groups of 32 to 256 columns .* \(32, 48\)"):
        OffloadEngine(make_plan(checkpoint_packed["int4"], expert_compute="kernel", device="cpu"))
    assert main(["generate", "--model", str(packs["int4"]), "--expert-compute", "fused", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--expert-compute 'fused': choose from auto, per-use, on-arrival, kernel" in err


@pytest.fixture(scope="module")
def checkpoint_packed(tmp_path_factory):
    """The runtime tests' model (down_proj [32, 48]: groups of 16) packed int4."""
    from model_configs import build

    root = tmp_path_factory.mktemp("forms-small")
    model, _ = build("mixtral", seed=3)
    model.half().save_pretrained(root / "model")
    tiny_tokenizer().save_pretrained(root / "model")
    pack_model(root / "model", root / "int4", expert_dtype="int4")
    return {"int4": root / "int4"}


def generations(engine):
    return {prompt: (result.token_ids, result.logits) for prompt in PROMPTS
            for result in [engine.generate(prompt, max_new_tokens=NEW_TOKENS, return_logits=True)]}


def assert_same(got, expected):
    for prompt, (tokens, logits) in expected.items():
        assert got[prompt][0] == tokens, prompt
        assert all(torch.equal(a, b) for a, b in zip(got[prompt][1], logits)), prompt


@pytest.fixture(scope="module")
def all_resident(packs):
    """(expert dtype, form, dtype) -> what the all-resident engine in that form generates."""
    cache = {}

    def of(expert_dtype, form, dtype):
        if (expert_dtype, form, dtype) not in cache:
            with OffloadEngine(make_plan(packs[expert_dtype], fast_budget="100%", preload=True, dtype=dtype,
                                         expert_compute=form, device="cpu")) as engine:
                cache[expert_dtype, form, dtype] = generations(engine)
        return cache[expert_dtype, form, dtype]
    return of


@pytest.mark.parametrize("expert_dtype, form, dtype, prefetch", [
    ("int4", "kernel", "bfloat16", "topk"), ("int4", "kernel", "float32", None),
    ("int4", "on-arrival", "float32", "topk"), ("int8", "on-arrival", "bfloat16", None),
    ("int8", "per-use", "float32", "topk"),
])
def test_every_form_is_lossless_against_the_all_resident_engine_in_that_form(packs, all_resident, expert_dtype,
                                                                             form, dtype, prefetch):
    manifest = read_manifest(packs[expert_dtype])
    slot = expert_form(form, manifest, torch.device("cpu"), getattr(torch, dtype)).slot_bytes
    with OffloadEngine(make_plan(packs[expert_dtype], fast_budget=f"{3 * slot}B", dtype=dtype, expert_compute=form,
                                 prefetch=prefetch, device="cpu")) as engine:
        assert engine.tiers[0].pool.slots == 3  # of 18 experts: most uses are loads
        assert_same(generations(engine), all_resident(expert_dtype, form, dtype))
        assert engine.stats.misses > 0


def test_dequantizing_on_arrival_gives_the_bits_of_dequantizing_per_use(all_resident):
    assert_same(all_resident("int4", "on-arrival", "float32"), all_resident("int4", "per-use", "float32"))


@pytest.mark.parametrize("form, dtype", [("kernel", "bfloat16"), ("per-use", "float32"), ("on-arrival", "float32")])
def test_quantized_experts_computed_on_the_host_are_lossless(packs, all_resident, monkeypatch, form, dtype):
    monkeypatch.setitem(POLICIES, OddLayersOnHost.name, PolicyInfo(OddLayersOnHost.name, OddLayersOnHost))
    manifest = read_manifest(packs["int4"])
    slot = expert_form(form, manifest, torch.device("cpu"), getattr(torch, dtype)).slot_bytes
    with OffloadEngine(make_plan(packs["int4"], fast_budget=f"{4 * slot}B", host_budget="40%", policy=OddLayersOnHost.name,
                                 dtype=dtype, expert_compute=form, device="cpu")) as engine:
        assert engine.tiers[1].pool.memory.dtype == torch.uint8  # the host tier holds the stored bytes
        assert_same(generations(engine), all_resident("int4", form, dtype))
        assert engine.stats.bypassed > 0 and engine.stats.host_compute_seconds > 0


def test_a_batch_computed_with_the_kernel_equals_each_request_alone(packs):
    from moe_offload.runtime.requests import SamplingParams

    tokens = [6, 3]
    with OffloadEngine(make_plan(packs["int4"], fast_budget="40%", dtype="bfloat16", expert_compute="kernel", device="cpu",
                                 max_batch=3)) as engine:
        assert engine.expert_form.name == "kernel"
        alone = [engine.generate(p, max_new_tokens=n, return_logits=True) for p, n in zip(PROMPTS, tokens)]
        handles = [engine.submit(p, SamplingParams(max_tokens=n, return_logits=True)) for p, n in zip(PROMPTS, tokens)]
        batched = [handle.result(timeout=RESULT_WAIT_S) for handle in handles]
    for completion, reference in zip(batched, alone):
        assert completion.token_ids == reference.token_ids
        assert all(torch.equal(a, b) for a, b in zip(completion.logits, reference.logits))
