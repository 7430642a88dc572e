"""The EAMs (Expert Activation Matrices) of the sequences running in one run of MoE-Infinity, shared by its
instances (one per tier): policies/moe_infinity.py derives them and how they rank experts."""

from __future__ import annotations


class SequenceEAMs:
    """The EAMs of the sequences running in one run, and their sum, shared by the run's MoE-Infinity
    instances (one per tier); see the docstring of policies/moe_infinity.py."""

    def __init__(self, num_layers: int, num_experts: int):
        self.num_layers, self.num_experts = num_layers, num_experts
        self.by_request: dict = {}  # request -> its EAM, [L][J] token counts
        self.running = [[0] * num_experts for _ in range(num_layers)]  # sum over by_request
        self.running_row_sum = [0] * num_layers
        self._rankers: list = []  # instances ranking by ``running``, told of every change
        self._last_clock = self._last_key = None  # the access counted last

    def eam(self, request) -> list:
        """The EAM of ``request`` so far (``[L][J]`` counts; zeros when it is not running)."""
        eam = self.by_request.get(request)
        return eam if eam is not None else [[0] * self.num_experts for _ in range(self.num_layers)]

    def count(self, key, ctx) -> None:
        """The access of ``key`` described by ``ctx``: each request's EAM gains its tokens (once per access)."""
        if ctx.clock == self._last_clock and key == self._last_key:  # another tier already counted this access
            return
        self._last_clock, self._last_key = ctx.clock, key
        layer, expert = divmod(key, self.num_experts)
        routed = ctx.routed
        if routed is None:  # one token of ctx.request (the replay)
            eam = self.by_request.get(ctx.request)
            if eam is None:
                eam = self.by_request[ctx.request] = [[0] * self.num_experts for _ in range(self.num_layers)]
            eam[layer][expert] += 1
            tokens = 1
        else:
            tokens = 0
            for request, routed_tokens in routed.items():
                eam = self.by_request.get(request)
                if eam is None:
                    eam = self.by_request[request] = [[0] * self.num_experts for _ in range(self.num_layers)]
                eam[layer][expert] += routed_tokens
                tokens += routed_tokens
        row = self.running[layer]
        row[expert] += tokens
        self.running_row_sum[layer] += tokens
        for ranker in self._rankers:
            ranker._count_changed(key, layer, row[expert])

    def end(self, request) -> None:
        """``request`` has run its last iteration: its EAM leaves the running sum and is forgotten."""
        eam = self.by_request.pop(request, None)
        if eam is None:
            return
        layers = []
        for layer, row in enumerate(eam):
            tokens = sum(row)
            if tokens:
                running = self.running[layer]
                for expert, count in enumerate(row):
                    running[expert] -= count
                self.running_row_sum[layer] -= tokens
                layers.append(layer)
        for ranker in self._rankers:
            ranker._rerank(layers)
