"""SGLang: what its expert-location options express on one GPU.

``--init-expert-location`` (``trivial``, or a file of a recorded expert distribution) and EPLB
(``--enable-eplb``, ``--ep-num-redundant-experts``) choose which *GPU* (expert-parallel rank) holds each
expert and how many replicas it has (sgl-project/sglang python/sglang/srt/eplb/expert_location.py and
eplb_manager.py). On one GPU there is one rank: every expert is on it, so below the memory of all experts
these options express nothing. What SGLang runs with less memory and is listed here is its ``kt`` backend
(``--kt-weight-path``, ``--kt-num-gpu-experts``, ``--kt-expert-placement-strategy``): those are KTransformers'
settings (moe_offload.engines.ktransformers), where ``--init-expert-location FILE.pt`` is the activation counts
of the ``frequency`` strategy.

Not modelled: SGLang's own weight offloading, which keeps no expert cache. ``--cpu-offload-gb G`` moves every
parameter of the first layers to host memory (a parameter at a time while less than G GiB is moved) and copies
them to the GPU before each forward; ``--offload-mode cpu --offload-group-size --offload-num-in-group
--offload-prefetch-step`` keeps the last layers of each group on the host and copies them a few layers ahead
on a side stream (``OffloaderV2``, python/sglang/srt/utils/offloader.py). Both stream whole layers every pass
whatever they route; the first also moves attention weights, whose size a routing trace does not give. The
second is the scheme vLLM's prefetch backend took from it, listed for vLLM (engines/vllm.py, timed by
simulator/timed/layerwise.py); SGLang hooks it only where a model's ``make_layers`` names the experts it
offloads (``offloader_kwargs``: the DeepSeek-V2 family's), and waits for a layer's copy once the layer is
routed rather than before its attention. No setting of them is listed.
"""

from __future__ import annotations

from moe_offload.engines import ktransformers
from moe_offload.engines.base import EngineModel, PlacementContext, Setting


def settings(context: PlacementContext) -> list[Setting]:
    out = ktransformers.settings(context)
    for setting in out:
        setting.engine = "sglang"
    return out


ENGINE = EngineModel(
    name="sglang", command="python -m sglang.launch_server --model MODEL --kt-weight-path WEIGHTS",
    source="sgl-project/sglang python/sglang/srt/eplb (expert location, EPLB); the kt backend's flags",
    settings=settings, reads_files=True,
    limits="--init-expert-location and EPLB place experts across GPUs: on one GPU they express nothing below "
           "all experts; the settings listed are its kt backend's (KTransformers); its whole-layer weight "
           "offloading (--cpu-offload-gb, --offload-group-size) is not modelled")
