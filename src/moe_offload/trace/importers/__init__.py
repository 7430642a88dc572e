"""Importers of routing recorded elsewhere, one module per family of formats.

research.py: ``topk-jsonl`` and ``routes-json``, traces published by research projects;
engines.py: ``vllm``, ``sglang`` and ``npy``, the routing serving engines return with their responses
(model_config.py reads the shape those lack from a Hugging Face config.json, responses.py the files,
arrays.py the binary arrays, engine_trace.py turns them into requests);
tools.py: ``csv`` (the generic format), ``llamacpp`` and ``megatron``, the logs of inference and training tools.

Every importer takes one path or a list of paths and shares the signature of :data:`IMPORTERS`' values::

    importer(paths, *, num_experts=None, model=None, expert_bytes=None, hidden_size=None,
             source=None, license=None, extra=None) -> Trace

(the engine importers also take ``model_config``). Malformed input raises TraceError naming the file and
the line, route, response or array at fault.
"""

from __future__ import annotations

from typing import Callable

from moe_offload.trace.format import Trace
from moe_offload.trace.importers.engines import import_npy, import_sglang, import_vllm
from moe_offload.trace.importers.research import import_routes_json, import_topk_jsonl
from moe_offload.trace.importers.tools import import_csv, import_llamacpp, import_megatron

Importer = Callable[..., Trace]

IMPORTERS: dict[str, Importer] = {
    "topk-jsonl": import_topk_jsonl,
    "routes-json": import_routes_json,
    "vllm": import_vllm,
    "sglang": import_sglang,
    "npy": import_npy,
    "csv": import_csv,
    "llamacpp": import_llamacpp,
    "megatron": import_megatron,
}
# the importers that read a model config (--model-config) for the shape their format lacks
TAKES_MODEL_CONFIG = ("vllm", "sglang", "npy", "csv", "llamacpp", "megatron")
# the importers that drop prompt tokens served from the prefix cache (--keep-cached-prompt keeps them)
TAKES_PROMPT_CACHE = ("vllm", "sglang")
# the importers that decode binary arrays of a declared size (--max-array-bytes)
TAKES_ARRAY_LIMIT = ("vllm", "sglang", "npy")
# the importers of many response or array files, read one at a time, that tell when each is done (on_file)
TELLS_EACH_FILE = ("vllm", "sglang", "npy")
# the importers of files that do not say where a request ends or which lines were a prompt (--request-rows,
# --prompt-rows say it)
TAKES_REQUEST_ROWS = ("topk-jsonl",)

__all__ = ["IMPORTERS", "TAKES_ARRAY_LIMIT", "TELLS_EACH_FILE", "TAKES_MODEL_CONFIG", "TAKES_PROMPT_CACHE",
           "TAKES_REQUEST_ROWS", "import_csv",
           "import_llamacpp", "import_megatron", "import_npy", "import_routes_json", "import_sglang", "import_topk_jsonl",
           "import_vllm"]
