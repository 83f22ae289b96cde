"""Multi-head latent attention (DeepSeek-V2/V3): the projections, the two latent norms, rope on
the rope dims, the latent KV write, and the absorbed attention through `backend.mla`.

Per token the cache keeps one row [rms-normed c_kv (kv_lora_rank) | roped k_pe
(qk_rope_head_dim)]. q_nope is absorbed through W_UK (kv_b_proj's key rows) into the latent
space and the latent output expanded through W_UV (its value rows), so attention reads only
the latent cache, prefill and decode alike. Paging belongs to the backend; this layer shapes
tensors and writes its rows. Under tensor parallelism each rank keeps its heads' rows of
q_proj / q_b_proj and kv_b_proj and their columns of o_proj (one all-reduce), and the whole
latent path (every rank writes the same latent rows to its own cache).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tandem.models.attention_backend import AttentionBackend
from tandem.models.batch import ForwardBatch
from tandem.models.config import ModelConfig
from tandem.models.layers.norm import RMSNorm
from tandem.models.layers.parallel import even_split, get_tp, row_parallel
from tandem.models.layers.rotary import RotaryEmbedding, _rope_type, _yarn_factor

# transformers builds both latent norms with its RMSNorm's default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(qk_nope + qk_rope), times mscale(factor, mscale_all_dim)^2 for a rope scaling
    that sets mscale_all_dim (YaRN), as transformers' DeepSeek attention computes it."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling: dict[str, Any] | None = config.rope_scaling
    if scaling and _rope_type(scaling) != "default":
        mscale_all_dim = scaling.get("mscale_all_dim") or 0
        if mscale_all_dim:
            factor, _ = _yarn_factor(scaling, config.max_position_embeddings)
            m = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * m * m
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., R] with rope pairs (x0, x1), (x2, x3), ... -> evens then odds, so the neox-style
    rotate_half rotates each original pair (transformers' interleaved DeepSeek rope)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend
        self.tp = get_tp()
        self.head_start, self.num_heads = even_split(
            config.num_attention_heads, self.tp, "num_attention_heads"
        )  # this rank's heads
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.rope_interleave = config.rope_interleave
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        hidden, heads, bias = config.hidden_size, self.num_heads, config.attention_bias
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if config.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, config.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * self.v_head_dim, hidden, bias=bias)
        self.scale = mla_softmax_scale(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        # x: [T, hidden]; cos/sin: [T, 1, qk_rope_head_dim]
        num_tokens = x.shape[0]
        heads, nope, rope = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_tokens, heads, nope + rope)
        q_nope, q_rope = q.split([nope, rope], dim=-1)  # [T, H, nope], [T, H, rope]
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)  # [T, L]
        k_rope = k_rope.reshape(num_tokens, 1, rope)
        if self.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope = RotaryEmbedding.apply(q_rope, cos, sin)
        k_rope = RotaryEmbedding.apply(k_rope, cos, sin)
        cache = batch.kv_cache.latent[self.layer_idx]  # [num_blocks, block_size, L + R]
        rows = torch.cat((c_kv, k_rope.view(num_tokens, rope)), dim=-1).to(cache.dtype)
        # A negative slot (a CUDA graph's padding row) writes nothing real: it lands in block 0,
        # the block pool's reserved null block, which no sequence reads.
        slots = batch.slot_mapping.clamp(min=0)
        cache.view(-1, cache.shape[-1]).index_copy_(0, slots, rows)
        w_kv = self.kv_b_proj.weight.view(heads, nope + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]  # [H, nope, L], [H, v, L]
        q_latent = torch.einsum("thd,hdl->thl", q_nope, w_uk)  # [T, H, L]
        out = self.backend.mla(q_latent, q_rope.contiguous(), cache, batch, self.scale)
        out = torch.einsum("thl,hvl->thv", out, w_uv)  # [T, H, v]
        return row_parallel(self.o_proj, out.reshape(num_tokens, heads * self.v_head_dim), self.tp)
