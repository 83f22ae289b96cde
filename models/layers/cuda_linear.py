"""Decode-sized dense linears on CUDA: `SkinnyLinear` and `use_cuda_skinny_linear(model)`.

At batch 1-2 a decode step's linears are weight-streaming GEMVs; ext/cuda's skinny kernel reads
weights at 2.5-3.1 TB/s on an H100 where cuBLAS reaches 2.0-2.8 (tools/bench_skinny_gemm.py,
docs/BENCHMARKS.md). Rows above `max_rows` go to F.linear on the same weight: the module is an
nn.Linear with another forward, so weights load and save under the same names.
Knows nothing about requests; the runner captures it in its graphs like any other op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.ext.cuda import (
    qk_norm_rope,  # registers torch.ops.tandem.qk_norm_rope
    skinny,  # noqa: F401  (registers torch.ops.tandem.skinny_*)
)
from tandem.models.batch import ForwardBatch
from tandem.models.layers.attention import Attention
from tandem.models.layers.mlp import GatedMLP

# Rows of x at or below which the kernel beats cuBLAS on every Llama-3 8B/1B projection
# (at 4 rows it wins on some and loses on others; docs/BENCHMARKS.md "GPU").
DEFAULT_MAX_ROWS = 2
# "gate": a MoE block's router (E outputs; launch-bound in cuBLAS at decode sizes)
_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "gate")


class SkinnyLinear(nn.Linear):
    max_rows: int = DEFAULT_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if x.numel() else 0
        if rows == 0 or rows > self.max_rows:
            return F.linear(x, self.weight, self.bias)
        # the op itself falls back to F.linear where the kernel does not apply (checked there:
        # data_ptr alignment checks would break a torch.compile graph here)
        y = torch.ops.tandem.skinny_linear(x, self.weight)
        return y if self.bias is None else y + self.bias


class SkinnyGatedMLP(GatedMLP):
    """GatedMLP whose gate_up projection and SiLU-mul are one kernel at 1-2 rows (saves the
    activation kernel and a round trip of [rows, 2 * intermediate] through memory)."""

    max_rows: int = DEFAULT_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if 0 < rows <= self.max_rows and self.gate_up_proj.bias is None:
            return self.down_proj(torch.ops.tandem.skinny_swiglu(x, self.gate_up_proj.weight))
        return super().forward(x)


class SkinnyAttention(Attention):
    """Attention whose decode prologue (qkv projection, rotary, KV write) is one kernel at 1-2
    tokens; needs a backend with `attend` (attention over an already written cache), no q/k
    norm (that needs a whole head, which no warp of the kernel holds) and no clip_qkv."""

    max_rows: int = DEFAULT_MAX_ROWS

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        t = x.shape[0]
        if not 0 < t <= self.max_rows or batch.kv_cache is None:
            return super().forward(x, cos, sin, batch)
        d = self.head_dim
        q = torch.ops.tandem.skinny_qkv_rope(
            x,
            self.qkv_proj.weight,
            self.qkv_proj.bias,
            cos.reshape(t, d),
            sin.reshape(t, d),
            batch.kv_cache.k[self.layer_idx],
            batch.kv_cache.v[self.layer_idx],
            batch.kv_tables(self.window)[1],
            self.num_heads,
            self.num_kv_heads,
        )
        out = self.backend.attend(self.layer_idx, q, batch, self.scale, self.window, self.sinks)
        return self.o_proj(out.reshape(t, self.q_size))


class NormRopeAttention(Attention):
    """Attention with per-head q/k norms (Qwen3) whose prologue after the qkv projection (both
    norms, rotary, KV write) is one kernel (`torch.ops.tandem.qk_norm_rope`) at any token
    count; needs a backend with `attend` and a KV cache in the batch. The kernel normalizes
    each head alone and clamps nothing: OLMoE's norms over the whole q/k row and its clip_qkv
    take the plain path."""

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        if (
            batch.kv_cache is None
            or self.q_norm is None
            or self.k_norm is None
            or self.qk_norm_full
            or self.clip_qkv is not None
        ):
            return super().forward(x, cos, sin, batch)
        t = x.shape[0]
        q = torch.ops.tandem.qk_norm_rope(
            self.qkv_proj(x),
            self.q_norm.weight,
            self.k_norm.weight,
            cos,
            sin,
            batch.kv_cache.k[self.layer_idx],
            batch.kv_cache.v[self.layer_idx],
            batch.kv_tables(self.window)[1],
            self.num_heads,
            self.num_kv_heads,
            self.q_norm.eps,
        )
        out = self.backend.attend(self.layer_idx, q, batch, self.scale, self.window, self.sinks)
        return self.o_proj(out.reshape(t, self.q_size))


class RopeAttention(Attention):
    """Attention without q/k norms whose prologue after the qkv projection (rotary, KV write)
    is one kernel (`torch.ops.tandem.rope_kv`) at any token count: for projections the skinny
    prologue does not fuse (packed GGUF weights, more than its rows). Needs a backend with
    `attend` and a KV cache in the batch."""

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        if batch.kv_cache is None:
            return super().forward(x, cos, sin, batch)
        t = x.shape[0]
        q = torch.ops.tandem.rope_kv(
            self.qkv_proj(x),
            cos,
            sin,
            batch.kv_cache.k[self.layer_idx],
            batch.kv_cache.v[self.layer_idx],
            batch.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        out = self.backend.attend(self.layer_idx, q, batch, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


def _swap(linear: nn.Linear, max_rows: int) -> SkinnyLinear:
    new = SkinnyLinear.__new__(SkinnyLinear)
    nn.Module.__init__(new)
    new.in_features, new.out_features = linear.in_features, linear.out_features
    new.weight = linear.weight  # the same Parameter: no copy
    new.bias = linear.bias
    new.max_rows = max_rows
    return new


class _SkinnyLogits:
    """compute_logits through the skinny kernel for a tied or untied lm_head (float32 out)."""

    def __init__(self, weight: torch.Tensor, max_rows: int) -> None:
        self.weight = weight
        self.max_rows = max_rows

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] <= self.max_rows:
            return torch.ops.tandem.skinny_linear(hidden, self.weight).float()
        return F.linear(hidden, self.weight).float()


def use_cuda_skinny_linear(model: nn.Module, max_rows: int = DEFAULT_MAX_ROWS) -> int:
    """Swaps the dense projections (qkv/o/gate_up/down) and the logits of a fp16/bf16 CUDA model
    for the skinny path, gated MLPs for the fused gate_up + SiLU-mul and attention layers for the
    fused qkv + rotary + KV write (backends with `attend`; with per-head q/k norms, or after a
    packed projection: the fused (norms +) rotary + KV write after the projection; OLMoE's
    whole-row norms and clip_qkv keep the plain Attention), in place; returns how many linears were swapped (0 for another dtype
    or device). MoE expert weights are not nn.Linears and stay as they are."""
    params = list(model.parameters())
    if (
        not params
        or not params[0].is_cuda
        or params[0].dtype not in (torch.float16, torch.bfloat16)
    ):
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in _TARGETS and type(child) is nn.Linear:
                setattr(parent, name, _swap(child, max_rows))
                swapped += 1
    for module in model.modules():  # same state, another forward
        if type(module) is GatedMLP and type(module.gate_up_proj) is SkinnyLinear:
            module.__class__ = SkinnyGatedMLP
            module.max_rows = max_rows
        elif (
            type(module) is Attention
            and type(module.qkv_proj) is SkinnyLinear
            and module.q_norm is None
            and module.clip_qkv is None
            and hasattr(module.backend, "attend")
            and module.head_dim % 16 == 0
            and module.rotary_dim == module.head_dim  # the fused kernels rotate every dim
        ):
            module.__class__ = SkinnyAttention
            module.max_rows = max_rows
        elif (
            type(module) is Attention
            and module.q_norm is not None
            and not module.qk_norm_full
            and module.clip_qkv is None
            and module.qkv_proj.bias is None
            and hasattr(module.backend, "attend")
            and module.head_dim in qk_norm_rope.HEAD_DIMS
            and module.rotary_dim == module.head_dim
        ):
            module.__class__ = NormRopeAttention
        elif (
            type(module) is Attention
            and type(module.qkv_proj) is not SkinnyLinear
            and not isinstance(module.qkv_proj, nn.Linear)  # packed (models/quant)
            and module.q_norm is None
            and module.clip_qkv is None
            and module.window is None
            and module.sinks is None
            and hasattr(module.backend, "attend")
            and module.head_dim in qk_norm_rope.HEAD_DIMS
            and module.rotary_dim == module.head_dim
        ):
            module.__class__ = RopeAttention
    packed_head = getattr(model, "quant_head", None) is not None  # models/quant owns it
    if (
        swapped
        and hasattr(model, "compute_logits")
        and hasattr(model, "embed_tokens")
        and not packed_head
    ):
        lm_head = getattr(model, "lm_head", None)
        weight = model.embed_tokens.weight if lm_head is None else lm_head.weight
        model.compute_logits = _SkinnyLogits(weight, max_rows)
        swapped += 1
    return swapped
