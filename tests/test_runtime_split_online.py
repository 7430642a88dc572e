"""MoEpic's online reconfiguration in the split runtime (runtime/split_online.py): lossless per pass against the
all-resident model switching split at the same pass boundaries, within rounding of the unsplit model; the rows
fitted to the budget by hand; what a changed ratio re-reads; one-line refusals of bad options."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from model_configs import tiny_tokenizer  # noqa: E402
from test_runtime_split import (HIDDEN, INTERMEDIATE, LAYERS, NEW_TOKENS, PROMPTS, TOP_K,  # noqa: E402
                                config, make_checkpoint, reference)

from moe_offload.cli.main import main  # noqa: E402
from moe_offload.models.adapters import load_model  # noqa: E402
from moe_offload.models.experts import use_project_experts  # noqa: E402
from moe_offload.plan import make_plan  # noqa: E402
from moe_offload.runtime.engine import OffloadEngine  # noqa: E402
from moe_offload.runtime.packing import read_manifest  # noqa: E402
from moe_offload.runtime.split_online import fit_rows  # noqa: E402
from moe_offload.simulator.split import LayerSplitPlan, SplitConfig  # noqa: E402
from moe_offload.simulator.timed import Reconfiguration  # noqa: E402

FAST_EXPERT_BYTES = 3 * INTERMEDIATE * HIDDEN * 4  # float32 on a CPU


@pytest.fixture(scope="module")
def split_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("split-online"))


def per_pass_reference(root, prompt, rows_of_pass):
    """Tokens and logits of the all-resident float32 model computing pass n in the split at ``rows_of_pass[n]``."""
    model, adapter = load_model(root / "model")
    passes = iter(rows_of_pass)

    def switch(module, args, kwargs):
        use_project_experts(adapter, None, list(next(passes)))

    model.model.register_forward_pre_hook(switch, with_kwargs=True)
    ids = tiny_tokenizer()(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, return_dict_in_generate=True, output_logits=True,
                             pad_token_id=0)
    return out.sequences[0, ids.shape[1]:].tolist(), [step[0] for step in out.logits]


@pytest.mark.parametrize("start, prefetch", [(([2] * LAYERS, [0.5] * LAYERS), None),
                                             (([4, 2, 1], [0.25, 0.5, 1.0]), "moepic"),
                                             (None, "moepic")])
def test_online_reconfiguration_is_lossless_per_pass(split_checkpoint, start, prefetch):
    """Every tau = 2 tokens the configurator reallocates; each pass computes in the split in force, so the run
    equals, bit for bit, the all-resident model switching split at the same passes (and it does switch)."""
    unsplit = reference(split_checkpoint, None)
    with OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget="100%" if start else "40%", device="cpu",
                                 prefetch=prefetch, split_config=config(*start) if start else None,
                                 reconfiguration=Reconfiguration(every=2))) as engine:
        split, seen = engine.split, set()
        for prompt in PROMPTS:
            rows_of_pass = []
            hook = engine.model.model.register_forward_pre_hook(
                lambda *_, passes=rows_of_pass: passes.append(tuple(split.rows)))
            result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, return_logits=True)
            hook.remove()
            seen.update(rows_of_pass)
            tokens, logits = per_pass_reference(split_checkpoint, prompt, rows_of_pass)
            assert result.token_ids == tokens
            assert all(torch.equal(a, b) for a, b in zip(result.logits, logits))
            gap = max(float((a - b).abs().max()) for a, b in zip(result.logits, unsplit[prompt][1]))
            assert gap < 1e-3  # rounding only, as for a fixed split
            assert split.memory_bytes <= engine.split.budget_bytes
        assert len(seen) > 1  # the split changed
        marks = [record["tokens"] // 2 for record in split.reconfigurations]  # one per tau tokens crossed
        assert marks and marks == sorted(set(marks)) and all(record["applied"] for record in split.reconfigurations)
        assert [layer["cache_size"] for layer in split.reconfigurations[-1]["layers"]] == split.cached_experts


def test_a_changed_ratio_rereads_the_kept_tops_whole_and_a_kept_one_moves_nothing(split_checkpoint):
    manifest = read_manifest(split_checkpoint / "packed")
    with OffloadEngine(make_plan(split_checkpoint / "packed", fast_budget="100%", device="cpu",
                                 split_config=config([3] * LAYERS, [0.5] * LAYERS))) as engine:
        engine.generate(PROMPTS[1], max_new_tokens=2)
        split = engine.split
        kept = [len(top) for top in split.tops]
        before = dict(engine.counters.bytes_per_link)
        new = SplitConfig((LayerSplitPlan(3, 0.25), LayerSplitPlan(3, 0.5), LayerSplitPlan(2, 0.5)))
        with split.cond:
            assert split.reconfigure(new, iteration=2, tokens=2)
        record = split.reconfigurations[-1]
        assert record["bytes_loaded"] == kept[0] * manifest.expert_bytes  # layer 0's ratio changed; the rest did not
        assert engine.counters.bytes_per_link["ssd->fast"] - before["ssd->fast"] == record["bytes_loaded"]
        assert split.rows == [12, 24, 24] and [len(top) for top in split.tops] == [kept[0], kept[1], min(kept[2], 2)]
        assert split.memory_bytes == (3 * 12 + 3 * 24 + 2 * 24 + TOP_K * 48) * 3 * HIDDEN * 4
        expected = reference(split_checkpoint, (12, 24, 24))  # every pass from now on in the new split
        result = engine.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS, return_logits=True)
        assert result.token_ids == expected[PROMPTS[0]][0]
        assert all(torch.equal(a, b) for a, b in zip(result.logits, expected[PROMPTS[0]][1]))


def test_rows_are_fitted_to_the_budget_one_at_a_time_from_the_largest_excess():
    """theta 0.2605 of 48 rows rounds up to 13 (excess 0.504), 0.51 down to 24: a budget one byte short of
    2 x 13 + 3 x 24 rows plus the buffer takes the row from layer 0; 0.001 of a row still gets one."""
    row = FAST_EXPERT_BYTES // INTERMEDIATE
    plans = SplitConfig((LayerSplitPlan(2, 0.2605), LayerSplitPlan(3, 0.51), LayerSplitPlan(1, 0.00001)))
    budget = row * (2 * 13 + 3 * 24 + 1 + TOP_K * INTERMEDIATE)
    fitted = fit_rows(plans, INTERMEDIATE, FAST_EXPERT_BYTES, TOP_K, budget)
    assert [round(p.split_ratio * INTERMEDIATE) for p in fitted.layers] == [13, 24, 1]
    fitted = fit_rows(plans, INTERMEDIATE, FAST_EXPERT_BYTES, TOP_K, budget - 1)
    assert [round(p.split_ratio * INTERMEDIATE) for p in fitted.layers] == [12, 24, 1]
    assert [p.cached_experts for p in fitted.layers] == [2, 3, 1]


def test_online_options_are_checked_with_one_line_errors(split_checkpoint, capsys):
    packed = str(split_checkpoint / "packed")
    for argv, problem in [(["--granularity", "0.1"], "--granularity belongs to the online configuration"),
                          (["--hardware", "no-such-preset"], "no-such-preset"),
                          (["--reconfigure-every", "0"], "tau must be a positive number"),
                          (["--reconfigure-every", "5", "--granularity", "2"], "zeta must be in (0, 1)"),
                          (["--reconfigure-every", "5", "--hardware", "no-such-preset"], "no-such-preset"),
                          (["--reconfigure-every", "5", "--fast-budget", "1%"], "give more")]:
        code = main(["generate", "hi", "--model", packed, "--device", "cpu", *argv])
        err = capsys.readouterr().err
        assert code == 2 and problem in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert main(["generate", "def", "--model", packed, "--device", "cpu", "--fast-budget", "60%",
                 "--reconfigure-every", "2", "--prefetch", "moepic", "--max-new-tokens", "4"]) == 0
    assert "online configuration: reconfigured" in capsys.readouterr().out
