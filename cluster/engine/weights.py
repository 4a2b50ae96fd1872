"""Loads a Hugging Face model directory (config.json + *.safetensors) into ``LlamaForCausalLM``.

HF checkpoints keep q/k/v and gate/up as separate tensors; they are concatenated here into
the fused projections the model runs, in the order the model splits them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from cluster.config import ModelConfig
from cluster.engine.model import LlamaForCausalLM
from cluster.errors import ModelLoadError

_FUSED = {
    "self_attn.q_proj": ("qkv_proj", 0),
    "self_attn.k_proj": ("qkv_proj", 1),
    "self_attn.v_proj": ("qkv_proj", 2),
    "mlp.gate_proj": ("gate_up_proj", 0),
    "mlp.up_proj": ("gate_up_proj", 1),
}
_RENAMED = {"self_attn.o_proj": "o_proj", "mlp.down_proj": "down_proj"}


def _read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors weights in {str(path)!r}; convert .bin checkpoints to safetensors first"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                tensors[name] = fh.get_tensor(name)
    return tensors


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    raw = _read_checkpoint(Path(cfg.path))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    state: dict[str, torch.Tensor] = {}
    fused_parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in raw.items():
        name = name.removeprefix("model.")
        if name.startswith("layers."):
            _, idx, rest = name.split(".", 2)
            module, _, kind = rest.rpartition(".")  # e.g. "self_attn.q_proj", "weight"
            prefix = f"layers.{idx}."
            if module in _FUSED:
                target, order = _FUSED[module]
                fused_parts.setdefault(f"{prefix}{target}.{kind}", {})[order] = tensor
                continue
            name = prefix + _RENAMED.get(module, module) + "." + kind
        state[name] = tensor
    for name, parts in fused_parts.items():
        state[name] = torch.cat([parts[i] for i in sorted(parts)], dim=0)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)

    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing = expected - state.keys()
    if missing:
        raise ModelLoadError(f"checkpoint in {cfg.path!r} lacks tensors {sorted(missing)[:5]} (of {len(missing)})")
    unexpected = state.keys() - expected
    if unexpected:
        raise ModelLoadError(
            f"checkpoint in {cfg.path!r} has tensors this architecture does not use: {sorted(unexpected)[:5]}"
        )
    for name, tensor in state.items():
        if tuple(model.state_dict()[name].shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"tensor {name} has shape {tuple(tensor.shape)} in the checkpoint, config.json implies "
                f"{tuple(model.state_dict()[name].shape)}"
            )
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.to(device)
    model.eval()
    return model
