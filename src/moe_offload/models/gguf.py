"""``--model FILE.gguf`` and ``--model ORG/NAME[@REVISION] --gguf-file FILE.gguf``: a llama.cpp GGUF checkpoint.

transformers reads a GGUF file by dequantizing every tensor to float (``from_pretrained(..., gguf_file=...)``,
with the ``gguf`` package's reader and dequantizers) and builds the config and tokenizer from its metadata. That
float model is saved as an ordinary safetensors checkpoint in a temporary directory and packed from there like
any checkpoint (runtime/packing.py, with ``--expert-dtype`` as usual), so a GGUF's Q4_K or Q8_0 blocks are never
moved as such: they become float32 values, then the pack's expert dtype. The pack is cached per GGUF file (its
SHA-256, or the hub commit it came from) and expert dtype, so a second start never reads the GGUF again.

Refused in one line, from the file's metadata alone and before any tensor is read:

* an architecture transformers cannot read from GGUF (OLMoE ``olmoe``, DeepSeek ``deepseek2``: no mapping);
* a file declaring ``llama`` (or ``mistral``) with ``llama.expert_count``: a Mixtral as llama.cpp converts it,
  which transformers builds as a dense Llama, dropping the experts;
* an architecture transformers reads but the project's adapters (models/adapters.py) do not know
  (``gpt-oss``, ``minimax-m2``, the dense ones);
* one shard of a GGUF split into several files (``split.count``): transformers reads the one file only;
* a file that is not GGUF, is truncated (a tensor ending past the end of the file), or declares more than
  its bytes hold (models/gguf_header.py: an array of 2^40 entries in a 4 kB file);
* a size of the model (``block_count``, ``expert_feed_forward_length``, ...; ``split.count``) that is not an
  integer, or more than the file's tensors hold (``block_count`` 2^31 beside a few dozen tensors).

A hub GGUF is named internally as ``ORG/NAME[@REVISION]:FILE.gguf`` (``--gguf-file`` builds it; llama.cpp's
``-hf ORG/NAME:QUANT`` reads alike), so it travels wherever ``--model`` does as one string.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
from pathlib import Path

from moe_offload.errors import ConfigError
from moe_offload.inputs import check_input, file_sha256
from moe_offload.models import _importable, quiet_transformers
from moe_offload.models.adapters import ARCHITECTURES, refuse_missing_tensors
from moe_offload.models.gguf_header import check_layout
from moe_offload.models.hub import hub_id, resolve_file

SUFFIX = ".gguf"
HUB_GGUF = re.compile(r"(?P<hub>[^:]+):(?P<file>[^:]+\.gguf)", re.IGNORECASE)
GGUF_MODULES = ("gguf", "accelerate")  # the `gguf` extra: transformers needs both to read a GGUF file
# The MoE GGUF architectures (general.architecture) transformers reads, and the model type each becomes; those
# whose model type models/adapters.ARCHITECTURES knows run.
MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
# Expert sizes a GGUF stores but transformers' GGUF config mapping leaves at the config class's default (768 for
# Qwen3-MoE: a file with other experts would load with mismatched shapes): GGUF key -> config field.
EXPERT_SIZES = {"expert_feed_forward_length": "moe_intermediate_size",
                "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}
# The GGUF sizes transformers' GGUF config mapping builds a model from (integers, each at most a tensor dimension)
SIZE_FIELDS = ("embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv",
               "attention.key_length", "attention.value_length", "expert_count", "expert_used_count",
               *EXPERT_SIZES)


def is_gguf(name: str) -> bool:
    """Whether ``--model NAME`` names a GGUF checkpoint: a local ``.gguf`` path, or ``ORG/NAME[@REV]:FILE.gguf``."""
    return name.lower().endswith(SUFFIX) and not Path(name).is_dir()


def with_gguf_file(model: str, gguf_file: str | None) -> str:
    """``--model`` as the rest of the project reads it, given ``--gguf-file`` (None: ``model`` unchanged)."""
    if gguf_file is None:
        return model
    if not gguf_file.lower().endswith(SUFFIX) or ":" in gguf_file:
        raise ConfigError(f"--gguf-file {gguf_file}: not a GGUF file name (FILE.gguf, as the hub repository "
                          "lists it)")
    if hub_id(model) is None:
        raise ConfigError(f"--gguf-file {gguf_file}: --model {model} is not a hub id (ORG/NAME[@REVISION]); a "
                          "local GGUF file is given as --model FILE.gguf")
    return f"{model}:{gguf_file}"


def require_gguf(what: str) -> None:
    """One line naming the extra to install when the packages transformers reads GGUF with are missing."""
    missing = [module for module in GGUF_MODULES if not _importable(module)]
    if missing:
        raise ConfigError(f"{what} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
                          "installed: pip install 'moe-offload[gguf]'")


def gguf_path(name: str) -> tuple[Path, str | None]:
    """(the GGUF file, the hub commit it came from or None for a local file) of ``--model NAME``; the file is
    checked to be a GGUF checkpoint the project can run (:func:`check_header`) before it is returned."""
    require_gguf(f"--model {name}")
    hub = HUB_GGUF.fullmatch(name)
    if hub is not None and not Path(name).exists():
        parsed = hub_id(hub["hub"])
        if parsed is None:
            raise ConfigError(f"--model {name}: {hub['hub']} is not a hub id (ORG/NAME[@REVISION])")
        path, commit = resolve_file(name, *parsed, hub["file"])
    else:
        path, commit = Path(name), None
        if not path.exists():
            raise ConfigError(f"{path}: no such GGUF file")
        check_input(path, "GGUF file")
    check_header(path)
    return path, commit


def pack_key(name: str, path: Path, commit: str | None) -> str:
    """What the pack of a GGUF checkpoint is cached under: the hub repository, commit and file, or the local
    file's name and SHA-256 (a replaced file is packed anew)."""
    if commit is not None:
        repo = HUB_GGUF.fullmatch(name)["hub"].split("@")[0]
        return f"{repo.replace('/', '--')}-{commit[:12]}-{path.stem}"
    return f"{path.stem}-{file_sha256(path)[:12]}"


def check_header(path: Path) -> dict[str, int]:
    """ConfigError in one line for every refusal of the module docstring, from the file's metadata (no tensor
    is read); else the config fields to set over transformers' GGUF config mapping (EXPERT_SIZES)."""
    import gguf

    check_layout(path)  # every declared count within the file's size, before the reader trusts them
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as exc:  # the reader's errors for a short or foreign file
        raise ConfigError(f"{path}: not a readable GGUF file (truncated or corrupt): "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise ConfigError(f"{path}: truncated: tensor {tensor.name} ends at byte "
                              f"{tensor.data_offset + tensor.n_bytes}, the file has {size}")
    try:
        fields = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("tokenizer.")}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a readable GGUF file: a metadata string is not UTF-8 ({exc.reason} at "
                          f"byte {exc.start})") from None
    shards = _integer(fields, "split.count", path, default=1)
    if shards > 1:  # transformers reads one file: the tensors of the other shards would be random weights
        raise ConfigError(f"{path}: shard {_integer(fields, 'split.no', path, default=0) + 1} of a GGUF split into "
                          f"{shards} files; "
                          "transformers reads single files: merge them first (`llama-gguf-split --merge "
                          f"{path.name} merged.gguf`)")
    architecture = fields.get("general.architecture")
    if not isinstance(architecture, str):
        raise ConfigError(f"{path}: no general.architecture in the GGUF metadata")
    experts = fields.get(f"{architecture}.expert_count")
    if architecture in ("llama", "mistral") and experts:
        raise ConfigError(f"{path}: declares architecture {architecture} with {architecture}.expert_count = "
                          f"{experts} (a Mixtral as llama.cpp converts it): transformers reads it as a dense "
                          "Llama and the experts would be lost; use the safetensors checkpoint instead")
    if MODEL_TYPES.get(architecture) not in ARCHITECTURES:
        readable = _transformers_reads(architecture)
        why = ("transformers reads it, as a model moe-offload's adapters do not know" if readable else
               "transformers cannot read this architecture from GGUF (no mapping)")
        runs = sorted(name for name, model_type in MODEL_TYPES.items() if model_type in ARCHITECTURES)
        raise ConfigError(f"{path}: GGUF architecture {architecture!r}: {why}; GGUF architectures that run: "
                          f"{', '.join(runs)}")
    _check_sizes(fields, architecture, reader.tensors, path)
    return {field: fields[f"{architecture}.{key}"] for key, field in EXPERT_SIZES.items()
            if f"{architecture}.{key}" in fields}


def _integer(fields: dict, key: str, path: Path, default: int | None = None) -> int | None:
    """The GGUF field ``key`` as a non-negative integer (``default`` when absent); ConfigError naming it when it
    holds something else (a string, a float, an array)."""
    value = fields.get(key, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        shown = repr(value)
        raise ConfigError(f"{path}: GGUF field {key} must be a non-negative integer, not "
                          f"{shown[:80] + '...' if len(shown) > 80 else shown}")
    return value


def _check_sizes(fields: dict, architecture: str, tensors, path: Path) -> None:
    """ConfigError naming the field when a size transformers builds the model from is not an integer or is more
    than the file's tensors hold: ``block_count`` past the number of tensors (each block has some), a width past
    the largest dimension of any tensor (each is one). transformers would otherwise build the declared model,
    layer by layer, before finding the tensors missing."""
    blocks = _integer(fields, f"{architecture}.block_count", path)
    if blocks is not None and not 1 <= blocks <= len(tensors):
        raise ConfigError(f"{path}: GGUF field {architecture}.block_count is {blocks:,}, and the file has "
                          f"{len(tensors):,} tensors: each block has some")
    widest = max((int(d) for tensor in tensors for d in tensor.shape), default=0)
    for key in SIZE_FIELDS:
        value = _integer(fields, f"{architecture}.{key}", path)
        if value is not None and value > widest:
            raise ConfigError(f"{path}: GGUF field {architecture}.{key} is {value:,}, more than any dimension of "
                              f"the file's tensors ({widest:,})")
    _integer(fields, f"{architecture}.context_length", path)


def _transformers_reads(architecture: str) -> bool:
    """Whether the installed transformers has a GGUF config mapping for ``architecture`` (only for the wording
    of a refusal)."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    known = {*GGUF_SUPPORTED_ARCHITECTURES, *GGUF_CONFIG_ARCHS}
    return architecture in known or architecture.replace("-", "_") in known


def write_checkpoint(path: Path, directory: Path) -> None:
    """Read the GGUF file ``path`` through transformers (every tensor dequantized to float32, as transformers
    loads a GGUF) and save it, with its tokenizer, as a safetensors checkpoint in ``directory``."""
    import torch
    import transformers
    from safetensors.torch import save_model

    config_fixes = check_header(path)
    quiet_transformers()
    folder, name = str(path.parent), path.name
    try:
        config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
        for field, value in config_fixes.items():
            setattr(config, field, value)
        model, loading = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, config=config, dtype=torch.float32, output_loading_info=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (OSError, ValueError, RuntimeError, KeyError, NotImplementedError) as exc:
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise ConfigError(f"{path}: transformers cannot read this GGUF file: {lines[0]}") from None
    refuse_missing_tensors(loading, f"{path}: the GGUF file lacks")
    # transformers marks a model read from GGUF as quantized (its GgufHfQuantizer), and save_pretrained refuses it;
    # for these architectures every weight was dequantized on reading, so the float tensors are saved as they are
    blocks = [name for name, tensor in model.state_dict().items() if not tensor.is_floating_point()]
    if blocks:
        raise ConfigError(f"{path}: transformers kept {blocks[0]} in GGUF blocks instead of dequantizing it")
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(directory)
    save_model(model, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(directory)


@contextlib.contextmanager
def float_checkpoint(path: Path, beside: Path):
    """The GGUF file ``path`` as a float safetensors checkpoint directory (:func:`write_checkpoint`) in a
    temporary folder inside ``beside`` (on the disk the pack goes to: it is the size of the float model),
    removed on exit."""
    beside.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{path.stem}-float-", dir=beside) as folder:
        write_checkpoint(path, Path(folder))
        yield Path(folder)
