"""Compute of ``hardware measure``: one expert at 1..64 tokens, the rest of an iteration with the experts
stubbed out, and one whole all-resident decode step of the runtime."""

from __future__ import annotations

import time
from pathlib import Path

from moe_offload.runtime.measure.timing import _median, _synchronizer, deviation, time_samples

TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64)
NO_EXPERTS = "moe_offload_measure_no_experts"


def measure_expert_compute(experts_module, tensors: dict, device, dtype, repeats: int,
                           token_counts=TOKEN_COUNTS, weights=None, host_copy: bool = False
                           ) -> tuple[dict[int, float], dict[int, float]]:
    """Seconds of one expert's work on n tokens, n in ``token_counts``: the per-expert body of
    models/experts.py (select the expert's tokens, gate_up, the module's own activation, down, the routing
    weight, index_add) with the expert's real weights, so shapes, dtype and activation are the model's.
    ``weights``: instead of ``tensors``, called at every step for the weights as the runtime's tier gives them
    (runtime/expert_forms.py: a quantized expert dequantized at each use, or ready). ``host_copy``: the expert
    as the runtime computes a bypassed one (models/host_experts.py), from the host tier's copy (``tensors`` in
    the stored dtype, or ``weights``), converted to ``dtype`` at every call, on the host; otherwise from a
    compute-ready copy in ``dtype`` on ``device``, as a resident expert.
    Returns (n -> median over the repeats, n -> the repeats' largest deviation from it, timing.deviation)."""
    import torch

    from moe_offload.models.host_experts import HostInputs, host_expert_output
    from moe_offload.models.experts import linear

    if weights is None:
        # the host tier keeps the stored dtype (converted at every call); a resident expert is compute-ready
        ready = {name: tensors[name].to(device) if host_copy else tensors[name].to(device, dtype=dtype)
                 for name in ("gate_up_proj", "down_proj")}

        def weights():
            return ready
    hidden = tensors["gate_up_proj"].shape[1]
    generator = torch.Generator().manual_seed(0)
    results, deviations = {}, {}
    for n in token_counts:
        states = torch.randn(n, hidden, generator=generator).to(device, dtype=dtype)
        top_k_index = torch.zeros(n, 1, dtype=torch.long, device=device)
        top_k_weights = torch.ones(n, 1, dtype=dtype, device=device)
        out = torch.zeros_like(states)

        def one_expert():
            top_k_pos, token_idx = torch.where((top_k_index == 0).transpose(0, 1))
            expert = weights()
            if host_copy:
                current = host_expert_output(experts_module, HostInputs(experts_module, states), token_idx.cpu(),
                                             expert, linear)
            else:
                current = linear(experts_module._apply_gate(linear(states[token_idx], expert["gate_up_proj"])),
                                 expert["down_proj"])
            current = current * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, current)

        with torch.inference_mode():
            samples = time_samples(one_expert, repeats, _synchronizer(device))
        results[n], deviations[n] = _median(samples), deviation(samples)
    return results, deviations


def _no_experts(self, hidden_states, top_k_index, top_k_weights):
    """An experts implementation that computes nothing: the skeleton's forward without the routed experts."""
    import torch

    return torch.zeros_like(hidden_states)


class _ModuleTimer:
    """Forward hooks that add up the seconds each group of modules spends, synchronizing a GPU first so
    that the time is the module's and not its predecessor's."""

    def __init__(self, sync):
        self.sync, self.seconds, self._started, self._handles = sync, {}, {}, []

    def watch(self, group: str, module) -> None:
        def before(mod, args):
            self.sync()
            self._started[id(mod)] = time.perf_counter()

        def after(mod, args, output):
            self.sync()
            self.seconds[group] = self.seconds.get(group, 0.0) + time.perf_counter() - self._started.pop(id(mod))

        self._handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def reset(self) -> None:
        self.seconds = {}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def measure_non_expert(model, adapter, device, repeats: int, token_counts=TOKEN_COUNTS) -> dict[str, dict[int, float]]:
    """Seconds per MoE layer of attention (everything a decoder layer does besides its router and its routed
    experts: norms, attention, residuals, shared experts, dense layers' MLPs) and of the router, and once per
    iteration of the LM head (everything outside the decoder layers: embedding, final norm, LM head), for a
    forward of n tokens with the routed experts stubbed out. Prefill without a KV cache: the simulator's
    costs are functions of the iteration's tokens only."""
    import torch
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if NO_EXPERTS not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(NO_EXPERTS, _no_experts)
    model.set_experts_implementation(NO_EXPERTS)
    sync = _synchronizer(device)
    timer = _ModuleTimer(sync)
    for layer in model.model.layers:
        timer.watch("layers", layer)
    for moe_layer in range(adapter.num_layers):
        timer.watch("router", adapter.router(moe_layer))
        timer.watch("experts", adapter.experts(moe_layer))
    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    results = {"attention": {}, "router": {}, "lm_head": {}}
    try:
        with torch.inference_mode():
            for n in token_counts:
                ids = torch.randint(0, vocab, (1, n), generator=generator).to(device)
                samples = {"attention": [], "router": [], "lm_head": []}
                for attempt in range(repeats + 1):  # the first is a warm-up
                    timer.reset()
                    sync()
                    started = time.perf_counter()
                    model(input_ids=ids, use_cache=False)
                    sync()
                    total = time.perf_counter() - started
                    if attempt == 0:
                        continue
                    layers, router = timer.seconds["layers"], timer.seconds.get("router", 0.0)
                    experts = timer.seconds.get("experts", 0.0)
                    samples["attention"].append((layers - router - experts) / adapter.num_layers)
                    samples["router"].append(router / adapter.num_layers)
                    samples["lm_head"].append(total - layers)
                for part, values in samples.items():
                    results[part][n] = max(_median(values), 0.0)
    finally:
        timer.close()
    return results


DECODE_PROBE_TOKENS = 16


def measure_decode_step(packed_dir: Path, device, repeats: int, dtype=None, stream=None) -> tuple[
        float, float | None, float | None]:
    """Median time between two output tokens of the runtime with every expert preloaded (greedy, a fixed
    16-token prompt, 16 new tokens, ``repeats`` times): the all-resident TPOT the simulator's costs must add up
    to. The median of the gaps, not their mean: a burst of other work on the machine moves a mean, not it.
    With ``stream`` (a context manager factory, transfers.streaming): the same again while it moves experts
    in the background, and the stream's median seconds per expert meanwhile. Returns (idle step, step while
    streaming, seconds per streamed expert while decoding); the last two None without ``stream``."""
    from moe_offload.plan import make_plan
    from moe_offload.runtime.engine import OffloadEngine

    dtype = None if dtype is None else str(dtype).removeprefix("torch.")  # ``dtype``: the compute dtype
    with OffloadEngine(make_plan(packed_dir, fast_budget="100%", preload=True, device=device, dtype=dtype)) as engine:
        prompt = list(range(1, 1 + DECODE_PROBE_TOKENS))

        def gaps() -> list[float]:
            return engine.generate(prompt, max_new_tokens=DECODE_PROBE_TOKENS).stats.token_latency_seconds

        idle = _median([gap for _ in range(max(2, repeats)) for gap in gaps()])
        if stream is None:
            return idle, None, None
        with stream() as per_expert:
            loaded, runs = [], 0
            while runs < max(2, repeats) or len(per_expert) < 2:  # two whole passes of the stream, at least
                loaded += gaps()
                runs += 1
            streamed = list(per_expert)
        return idle, _median(loaded), _median(streamed)
