"""Qwen3-style attention prologue in one kernel (`qk_norm_rope.cu`): per-head q/k RMSNorm,
neox rotary and the paged KV write from the fused qkv output, as the torch custom op
`torch.ops.tandem.qk_norm_rope` (returns q; writes k and v into their cache slots), and the same
without norms, `torch.ops.tandem.rope_kv` (Llama-style attention after a packed projection).

`qk_norm_rope_ref` / `rope_kv_ref` are the torch expressions they replace
(models/layers/attention.py with a KV write), also the fall-backs where the kernel does not
apply.
"""

from __future__ import annotations

import torch

from tandem.ext.attention_ref import rotate_neox, write_kv
from tandem.ext.cuda._loader import f32, i32, i64, launch, ptr
from tandem.ext.cuda.norm import rms_norm_ref

_DT = {torch.float16: 0, torch.bfloat16: 1}
HEAD_DIMS = (64, 128, 256)


def qk_norm_rope_ref(qkv, q_w, k_w, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                     num_kv_heads, eps):  # fmt: skip
    """The torch expression: q [T, H, D]; k/v written to the slots >= 0 of the caches."""
    T = qkv.shape[0]
    D = q_w.shape[0]
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    c, s = cos.reshape(T, 1, D), sin.reshape(T, 1, D)
    q = rotate_neox(rms_norm_ref(q.reshape(T, num_heads, D), q_w, eps), c, s)
    k = rotate_neox(rms_norm_ref(k.reshape(T, num_kv_heads, D), k_w, eps), c, s)
    keep = slot_mapping >= 0
    write_kv(k_cache, v_cache, k[keep], v.reshape(T, num_kv_heads, D)[keep], slot_mapping[keep])
    return q.contiguous()


def supported(qkv, q_w, k_w, cos, sin, k_cache, v_cache, num_heads, num_kv_heads) -> bool:
    """Whether the kernel takes these operands (else the torch expression)."""
    D = q_w.shape[0] if q_w.dim() == 1 else -1
    if any(t.dtype != qkv.dtype or t.device != qkv.device for t in (q_w, k_w)):
        return False
    if k_w.shape != (D,) or not (q_w.is_contiguous() and k_w.is_contiguous()):
        return False
    return rope_supported(qkv, D, cos, sin, k_cache, v_cache, num_heads, num_kv_heads)


def rope_supported(qkv, D, cos, sin, k_cache, v_cache, num_heads, num_kv_heads) -> bool:
    """Whether the kernel (norms or not) takes these operands, heads of size D."""
    if not (qkv.is_cuda and qkv.dtype in _DT and D in HEAD_DIMS):
        return False
    if any(t.dtype != qkv.dtype or t.device != qkv.device for t in (cos, sin, k_cache, v_cache)):
        return False
    T = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * D or qkv.stride(1) != 1:
        return False
    for t in (cos, sin):
        if t.numel() != T * D or t.reshape(T, D).stride(1) != 1:
            return False
    return k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[-1] == D


@torch.library.custom_op("tandem::qk_norm_rope", mutates_args=("k_cache", "v_cache"))
def qk_norm_rope(
    qkv: torch.Tensor,  # [T, (H + 2 KVH) * D]
    q_w: torch.Tensor,  # [D] q_norm weight
    k_w: torch.Tensor,  # [D] k_norm weight
    cos: torch.Tensor,  # [T, 1, D] or [T, D]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    num_heads: int,
    num_kv_heads: int,
    eps: float,
) -> torch.Tensor:
    """-> q [T, H, D], normalized and rotated; k (normalized, rotated) and v into their slots."""
    args = (qkv, q_w, k_w, cos, sin, k_cache, v_cache, num_heads, num_kv_heads)
    if not supported(*args):
        return qk_norm_rope_ref(qkv, q_w, k_w, cos, sin, k_cache, v_cache, slot_mapping,
                                num_heads, num_kv_heads, eps)  # fmt: skip
    T, D = qkv.shape[0], q_w.shape[0]
    q = torch.empty(T, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    c, s = cos.reshape(T, D), sin.reshape(T, D)
    warps = T * (num_heads + 2 * num_kv_heads)
    launch(
        "qk_norm_rope.cu",
        f"qk_norm_rope_kernel<{_DT[qkv.dtype]},{D}>",
        qkv.device,
        (-(-warps // 8), 1, 1),
        (256, 1, 1),
        (ptr(qkv), i64(qkv.stride(0)), ptr(q_w), ptr(k_w), ptr(c), ptr(s), i64(c.stride(0)),
         ptr(q), ptr(k_cache), ptr(v_cache), ptr(slot_mapping.contiguous()), i32(T),
         i32(num_heads), i32(num_kv_heads), f32(eps)),
        pdl=True,
    )  # fmt: skip
    return q


@qk_norm_rope.register_fake
def _(qkv, q_w, k_w, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, eps):
    return qkv.new_empty(qkv.shape[0], num_heads, q_w.shape[0])


def rope_kv_ref(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim):
    """The torch expression without norms: q [T, H, D] rotated; k rotated and v written."""
    T, D = qkv.shape[0], head_dim
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    c, s = cos.reshape(T, 1, D), sin.reshape(T, 1, D)
    q = rotate_neox(q.reshape(T, num_heads, D), c, s)
    k = rotate_neox(k.reshape(T, num_kv_heads, D), c, s)
    keep = slot_mapping >= 0
    write_kv(k_cache, v_cache, k[keep], v.reshape(T, num_kv_heads, D)[keep], slot_mapping[keep])
    return q.contiguous()


@torch.library.custom_op("tandem::rope_kv", mutates_args=("k_cache", "v_cache"))
def rope_kv(
    qkv: torch.Tensor,  # [T, (H + 2 KVH) * D]
    cos: torch.Tensor,  # [T, 1, D] or [T, D]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """-> q [T, H, D] rotated; k (rotated) and v into their slots: qk_norm_rope without norms."""
    args = (qkv, head_dim, cos, sin, k_cache, v_cache, num_heads, num_kv_heads)
    if not rope_supported(*args):
        return rope_kv_ref(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                           num_kv_heads, head_dim)  # fmt: skip
    T, D = qkv.shape[0], head_dim
    q = torch.empty(T, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    c, s = cos.reshape(T, D), sin.reshape(T, D)
    warps = T * (num_heads + 2 * num_kv_heads)
    launch(
        "qk_norm_rope.cu",
        f"qk_norm_rope_kernel<{_DT[qkv.dtype]},{D},0>",
        qkv.device,
        (-(-warps // 8), 1, 1),
        (256, 1, 1),
        (ptr(qkv), i64(qkv.stride(0)), ptr(None), ptr(None), ptr(c), ptr(s), i64(c.stride(0)),
         ptr(q), ptr(k_cache), ptr(v_cache), ptr(slot_mapping.contiguous()), i32(T),
         i32(num_heads), i32(num_kv_heads), f32(0.0)),
        pdl=True,
    )  # fmt: skip
    return q


@rope_kv.register_fake
def _(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim):
    return qkv.new_empty(qkv.shape[0], num_heads, head_dim)
