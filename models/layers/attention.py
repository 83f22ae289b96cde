"""Self-attention layer: fused qkv projection, optional q/k/v bias (Qwen2; Llama and Qwen3 with
attention_bias), q/k RMSNorm per head (Qwen3) or over the whole projected q and k (OLMoE), the
optional clamp of q/k/v (OLMoE's clip_qkv), rotary, the attention backend (told this layer's
sliding window and GPT-OSS's per-head sinks), o_proj (with a bias where the checkpoint has one). Paging and KV storage belong to the backend; this layer only
shapes tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.attention_backend import AttentionBackend
from tandem.models.batch import ForwardBatch
from tandem.models.config import ModelConfig
from tandem.models.layers.norm import RMSNorm
from tandem.models.layers.parallel import get_tp, head_split, row_parallel, sharded_rms_norm
from tandem.models.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        if config.num_attention_heads % config.num_key_value_heads != 0:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.layer_idx = layer_idx
        self.backend = backend
        self.tp = tp = get_tp()
        # this rank's heads (all of them without tensor parallelism)
        q0, self.num_heads, kv0, self.num_kv_heads = head_split(
            config.num_attention_heads, config.num_key_value_heads, tp
        )
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim  # < head_dim: partial rotary (GLM-4.5)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.q_start, self.kv_start = q0 * self.head_dim, kv0 * self.head_dim
        self.full_q_size, self.full_kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        # per head: [D] weights on [T, H, D]; full (OLMoE): [q_size] / [kv_size] on [T, H * D]
        self.qk_norm_full = config.qk_norm and config.qk_norm_full
        q_width, k_width = (
            (self.q_size, self.kv_size) if self.qk_norm_full else (self.head_dim, self.head_dim)
        )
        self.q_norm = RMSNorm(q_width, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(k_width, config.rms_norm_eps) if config.qk_norm else None
        self.clip_qkv = config.clip_qkv
        self.window = config.layer_window(layer_idx)
        # GPT-OSS: one learned logit per head in the softmax's denominator, [H]
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        # x: [T, hidden]; cos/sin: [T, 1, head_dim]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_full and self.q_norm is not None and self.k_norm is not None:
            if self.tp.size > 1:  # the row's columns are split across ranks
                q = sharded_rms_norm(
                    q, self.q_norm.weight, self.q_norm.eps, self.full_q_size, self.tp
                )
                k = sharded_rms_norm(
                    k, self.k_norm.weight, self.k_norm.eps, self.full_kv_size, self.tp
                )
            else:
                q = self.q_norm(q)  # over the whole [T, q_size] row, as OLMoE does
                k = self.k_norm(k)
        if self.clip_qkv is not None:  # after the norms, before rotary (transformers' order)
            q = q.clamp(-self.clip_qkv, self.clip_qkv)
            k = k.clamp(-self.clip_qkv, self.clip_qkv)
            v = v.clamp(-self.clip_qkv, self.clip_qkv)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        if not self.qk_norm_full and self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)  # per head
            k = self.k_norm(k)
        q = RotaryEmbedding.apply_(q, cos, sin)  # q, k: this forward's own temporaries
        k = RotaryEmbedding.apply_(k, cos, sin)
        if self.window is None and self.sinks is None:
            out = self.backend.forward(self.layer_idx, q, k, v, batch, self.scale)  # [T, H, D]
        else:
            out = self.backend.forward(
                self.layer_idx, q, k, v, batch, self.scale, window=self.window, sinks=self.sinks
            )
        return row_parallel(self.o_proj, out.reshape(num_tokens, self.q_size), self.tp)
