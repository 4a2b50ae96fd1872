"""Loading a model directory's tokenizer (the router and the engine load the same one).

transformers' tokenizer classes do not import torch, so the HTTP ingress can tokenize
without loading the model code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cluster.errors import ModelLoadError


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if not any((Path(path) / f).is_file() for f in files):
        raise ModelLoadError(f"no tokenizer in {path!r}: expected one of {files}")
    try:
        return AutoTokenizer.from_pretrained(path, **_plain_config(Path(path)))
    except Exception as e:  # transformers raises many types for a broken directory
        raise ModelLoadError(f"cannot load the tokenizer from {path!r}: {e}") from e


#: What ``AutoTokenizer`` reads from a model config to choose the tokenizer class.
_TOKENIZER_CHOICE_FIELDS = ("model_type", "tokenizer_class", "model_name")


def _plain_config(path: Path) -> dict[str, Any]:
    """``{"config": ...}`` for ``AutoTokenizer`` when the directory names its tokenizer class, else ``{}``.

    Given no config, ``AutoTokenizer`` loads the model's config class (``LlamaConfig``), whose module imports
    torch._dynamo and torch.distributed through transformers' kernel integrations: ~2 s of a replica's start,
    for two fields. When ``tokenizer_config.json`` names the class (and brings no code of its own), the class is
    chosen from that name and the config's ``model_type``, which a plain ``PreTrainedConfig`` carrying the same
    fields of ``config.json`` gives; the config's Python type only matters when the class is not named.
    """
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        model_config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(tokenizer_config, dict) or not isinstance(model_config, dict):
        return {}
    if not tokenizer_config.get("tokenizer_class") or "auto_map" in tokenizer_config or "auto_map" in model_config:
        return {}
    from transformers.configuration_utils import PreTrainedConfig

    # Only the fields AutoTokenizer reads: a generic config given the model's other fields would run their
    # validation (rope scaling, per-layer attributes) without the model class's defaults, and can fail.
    try:
        config = PreTrainedConfig.from_dict({k: model_config[k] for k in _TOKENIZER_CHOICE_FIELDS if k in model_config})
    except Exception:  # noqa: BLE001 - whatever transformers objects to, AutoConfig's own path decides
        return {}
    config._name_or_path = str(path)  # what AutoConfig would set; AutoTokenizer matches some checkpoints by it
    return {"config": config}
