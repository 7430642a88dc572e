"""What ``pack`` checks in a checkpoint directory, so that a broken one is refused naming the file or the
tensor instead of being packed into a model that generates other text.

Before anything is built (:func:`check_checkpoint_files`), from the files' headers only:

- ``config.json`` is standard JSON (inputs.parse_json: no ``NaN``, such as a NaN ``rms_norm_eps``, which
  would make every norm's output NaN; no nesting deeper than the parser takes), an object, with positive
  norm epsilons and a layer count in 1..MAX_LAYERS;
- the weight index (``model.safetensors.index.json``) maps tensors to plain file names inside the directory:
  a ``weight_map`` entry such as ``../../../../etc/passwd`` would make transformers read a file outside the
  checkpoint;
- the layers the weight files hold (``layers.N.`` in their tensor names, read from the safetensors headers,
  no tensor data) are exactly ``num_hidden_layers`` of them: a config with fewer layers than the weights
  silently drops the last layers, one with more builds layers of random weights (and with 10^9 of them
  never ends building);
- every weight file is a readable regular file (inputs.check_input).

After loading (:func:`check_loaded_weights`), every weight is finite: a NaN weight makes every logit NaN
and generation emits one token forever. (That no tensor of the model is missing from the files, one layer's
experts say, is load_model's check: transformers would fill it with random values.)
"""

from __future__ import annotations

import re
from pathlib import Path

from moe_offload.errors import ConfigError
from moe_offload.inputs import check_input, parse_json, read_text

INDEX = "model.safetensors.index.json"
LAYER_IN_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# 16x DeepSeek-V3's 61 layers: a bound that reads no config as a request to build a billion layers
MAX_LAYERS = 1024


def check_checkpoint_files(model_dir: Path) -> dict:
    """The checkpoint's config.json as a dict, once the checks of the module doc hold; else ConfigError."""
    config_file = model_dir / "config.json"
    config = parse_json(read_text(config_file, "model config"), config_file, "model config")
    if not isinstance(config, dict):
        raise ConfigError(f"{config_file}: a model config must be a JSON object, not {type(config).__name__}")
    _check_epsilons(config, config_file)
    weights = _weight_files(model_dir)
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= MAX_LAYERS:
        raise ConfigError(f"{config_file}: num_hidden_layers must be an integer in 1..{MAX_LAYERS}, not {layers!r}")
    held = _layers_in(weights)
    # DeepSeek-V3's checkpoints add its multi-token-prediction layers after the decoder's; transformers skips them
    extra = config.get("num_nextn_predict_layers") or 0
    if held and max(held) >= layers + (extra if isinstance(extra, int) else 0):
        layer = max(held)
        raise ConfigError(f"{held[layer]}: holds layer {layer}, but {config_file} has num_hidden_layers={layers}; "
                          "the config does not describe these weights")
    if held:
        absent = sorted(set(range(layers)) - set(held))
        if absent:
            raise ConfigError(f"{model_dir}: the weight files hold no tensor of layer {absent[0]}, but {config_file} "
                              f"has num_hidden_layers={layers}")
    return config


def check_loaded_weights(model) -> None:
    """ConfigError naming the first weight of ``model`` that holds NaN or infinity."""
    import torch

    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ConfigError(f"weight {name} holds NaN or infinity; the checkpoint is damaged")


def _check_epsilons(config: dict, config_file: Path) -> None:
    """A norm's epsilon that is zero or negative: the norm divides by the root of the mean square plus it."""
    for key, value in config.items():
        if key.endswith("_eps") and isinstance(value, (int, float)) and not value > 0:
            raise ConfigError(f"{config_file}: {key} must be a positive number, not {value!r}")


def _weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: those the index names (each checked to lie in ``model_dir``), else every
    ``*.safetensors`` there; each a readable regular file."""
    index = model_dir / INDEX
    if index.exists():
        document = parse_json(read_text(index, "weight index"), index, "weight index")
        weight_map = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{index}: weight_map must be an object of tensor names and weight files")
        names = set()
        for tensor, file in weight_map.items():
            if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
                raise ConfigError(f"{index}: weight_map maps {tensor} to {file!r}, not the name of a file in "
                                  f"{model_dir}")
            names.add(file)
        files = [model_dir / name for name in sorted(names)]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    for file in files:
        check_input(file, "weight file")
    return files


def _layers_in(files: list[Path]) -> dict[int, Path]:
    """Decoder-layer index -> a weight file holding a tensor of it, from the safetensors headers."""
    from safetensors import SafetensorError, safe_open

    held = {}
    for file in files:
        try:
            with safe_open(file, "pt") as handle:
                names = list(handle.keys())
        except (SafetensorError, OSError, ValueError) as exc:
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            raise ConfigError(f"{file}: the checkpoint cannot be loaded: not a safetensors file, or corrupt or "
                              f"truncated ({lines[0]})") from None
        for name in names:
            match = LAYER_IN_NAME.search(name)
            if match:
                held.setdefault(int(match.group(1)), file)
    return held
