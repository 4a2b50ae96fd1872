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
    files = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if not any((Path(path) / f).is_file() for f in files):
        raise ModelLoadError(f"no tokenizer in {path!r}: expected one of {files}")
    try:
        if _is_plain_tokenizers_backend(Path(path)):
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, **_plain_config(Path(path)))
    except Exception as e:  # transformers raises many types for a broken directory
        raise ModelLoadError(f"cannot load the tokenizer from {path!r}: {e}") from e


#: ``tokenizer_class`` values that name transformers' generic ``tokenizer.json`` class (what transformers 5 writes,
#: and what Llama 3 checkpoints name).
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
#: Model types for which ``AutoTokenizer`` keeps a generic class named by the directory (transformers overrides
#: the named class for some types, e.g. qwen2 and mistral; those go through ``AutoTokenizer``).
_GENERIC_CLASS_MODEL_TYPES = ("llama",)


def _is_plain_tokenizers_backend(path: Path) -> bool:
    """True when ``AutoTokenizer`` would load ``TokenizersBackend`` from ``tokenizer.json`` itself: a llama
    directory naming the generic class, with no code of its own. Then the class is loaded directly: importing
    ``AutoTokenizer`` indexes every model package of transformers (~1 s of a replica's start).
    tests/unit/test_tokenizer_loading.py checks both paths give the same tokenizer."""
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        model_config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(tokenizer_config, dict) or not isinstance(model_config, dict):
        return False
    return (
        (path / "tokenizer.json").is_file()
        and tokenizer_config.get("tokenizer_class") in _GENERIC_CLASSES
        and model_config.get("model_type") in _GENERIC_CLASS_MODEL_TYPES
        and "auto_map" not in tokenizer_config
        and "auto_map" not in model_config
    )


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
