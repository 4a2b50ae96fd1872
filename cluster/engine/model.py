"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) written against the paged KV cache.

One forward call runs a flat batch of tokens from many requests (decodes and prefill
chunks mixed): every linear layer is one matmul over all of them; only attention looks at
per-sequence structure, through the attention backend and its metadata.
q/k/v and gate/up projections are fused at load time, so a layer is four matmuls.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cluster.config import ModelConfig
from cluster.engine.attention.base import AttentionBackend, AttentionMetadata
from cluster.engine.layer_ops import TORCH_LAYER_OPS, LayerOps, rms_norm_ref
from cluster.engine.linear import Linear


class RMSNorm(nn.Module):
    """Holds the norm's weight (checkpoint names); the layers run it through their ``LayerOps``."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, looked up by position id (no per-step trig)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        dim = cfg.head_dim
        # Computed on the CPU even when the model is built on the meta device (weights.load_model): the
        # tables are no checkpoint weights, and meta-device math would load torch's reference ops (seconds).
        cpu = torch.device("cpu")
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=cpu).float() / dim))
        if cfg.rope_scaling_dict:
            inv_freq = _llama3_inv_freq(inv_freq, cfg.rope_scaling_dict)
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32, device=cpu)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos(), persistent=False)  # [max_pos, head_dim]
        self.register_buffer("sin", emb.sin(), persistent=False)

    def rotate_qk_(self, ops: LayerOps, qkv: torch.Tensor, positions: torch.Tensor, rotated_heads: int) -> None:
        """Rotates the q and k heads at the start of each row of ``qkv`` in place, by the angles of ``positions``."""
        ops.rotary_qk_(qkv, positions, rotated_heads, self.cos.shape[-1], self.cos, self.sin)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, hidden, residual, positions, rotary, kv_cache_layer, meta, backend: AttentionBackend, ops):
        """hidden: [T, hidden], the last layer's output before its residual add; residual: the sum so far (None
        before the first layer). Returns the same pair for the next layer: the adds are fused into the norms.
        kv_cache_layer: [2, num_blocks, block_size, kv_heads, head_dim]."""
        norm = self.input_layernorm
        if residual is None:
            residual, x = hidden, ops.rms_norm(hidden, norm.weight, norm.eps)
        else:
            x, residual = ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        qkv = self.qkv_proj(x)
        rotary.rotate_qk_(ops, qkv, positions, self.num_heads + self.num_kv_heads)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache_layer[0], kv_cache_layer[1]
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        attn = backend.attend(q, k_cache, v_cache, meta, self.scale, key=k, value=v)

        norm = self.post_attention_layernorm
        x, residual = ops.add_rms_norm(self.o_proj(attn.reshape(-1, self.q_size)), residual, norm.weight, norm.eps)
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x))), residual


class LlamaForCausalLM(nn.Module):
    #: The element-wise ops' code (``layer_ops.choose_layer_ops``); the engine sets the one for its dtype and device.
    layer_ops: LayerOps = TORCH_LAYER_OPS

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # Given a weight, Embedding skips its random init: under the meta device (weights.load_model) that
        # init goes through torch's compiler machinery and costs seconds of start-up.
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.rotary = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]. Writes this step's K/V into kv_cache."""
        ops = self.layer_ops
        hidden, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, positions, self.rotary, kv_cache[i], meta, backend, ops)
        if residual is None:  # a model without layers
            return ops.rms_norm(hidden, self.norm.weight, self.norm.eps)
        return ops.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] -> float32 logits [B, vocab]."""
        return self.lm_head(hidden).float()
