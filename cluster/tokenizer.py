"""Loading a model directory's tokenizer (the router and the engine load the same one).

transformers' tokenizer classes do not import torch, so the HTTP ingress can tokenize
without loading the model code.
"""

from __future__ import annotations

from pathlib import Path

from cluster.errors import ModelLoadError


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if not any((Path(path) / f).is_file() for f in files):
        raise ModelLoadError(f"no tokenizer in {path!r}: expected one of {files}")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types for a broken directory
        raise ModelLoadError(f"cannot load the tokenizer from {path!r}: {e}") from e
