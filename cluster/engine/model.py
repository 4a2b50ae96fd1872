"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) written against the paged KV cache.

One forward call runs a flat batch of tokens from many requests (decodes and prefill
chunks mixed): every linear layer is one matmul over all of them; only attention looks at
per-sequence structure, through the attention backend and its metadata.
q/k/v and gate/up projections are fused at load time, so a layer is four matmuls.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cluster.config import ModelConfig
from cluster.engine.attention.base import AttentionBackend, AttentionMetadata
from cluster.engine.linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 like the reference implementation, then cast back.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: [T, Hq, D], k: [T, Hkv, D], positions: [T]
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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

    def forward(self, hidden, positions, rotary, kv_cache_layer, meta, backend: AttentionBackend):
        # hidden: [T, hidden]; kv_cache_layer: [2, num_blocks, block_size, kv_heads, head_dim]
        residual = hidden
        x = self.input_layernorm(hidden)
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        k_cache, v_cache = kv_cache_layer[0], kv_cache_layer[1]
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        attn = backend.attend(q, k_cache, v_cache, meta, self.scale)
        hidden = residual + self.o_proj(attn.reshape(-1, self.q_size))

        residual = hidden
        x = self.post_attention_layernorm(hidden)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return residual + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
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
        hidden = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, positions, self.rotary, kv_cache[i], meta, backend)
        return self.norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] -> float32 logits [B, vocab]."""
        return self.lm_head(hidden).float()
