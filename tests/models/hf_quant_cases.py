"""A reference quantizer for the HF quantized formats Tandem serves (GPTQ, AWQ, FP8): round to
nearest per group (GPTQ's error-correcting search is not needed to make a valid file), packed
into each format's real on-disk layout, written over a tiny random HF checkpoint. The packing
is written here from the formats' descriptions, independently of models/quant/int4.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as hf
from safetensors.torch import load_file, save_file

from tandem.models.quant.fp8 import Fp8Tensor
from tandem.models.quant.int4 import Int4Tensor, pack_codes
from tests.models.deepseek_cases import save_random_hf

AWQ_PACK = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_PACK[i]
PROJ = (".q_proj.", ".k_proj.", ".v_proj.", ".o_proj.", ".gate_proj.", ".up_proj.", ".down_proj.")

DENSE = dict(
    vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, initializer_range=0.05,
)  # fmt: skip


def dense_config() -> hf.PretrainedConfig:
    return hf.LlamaConfig(**DENSE)


def moe_config() -> hf.PretrainedConfig:
    return hf.Qwen3MoeConfig(
        **DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        norm_topk_prob=True, mlp_only_layers=[0],
    )  # fmt: skip


def rtn_int4(
    w: torch.Tensor, group: int, sym: bool, order: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> codes [N, K] int, scales [N, G] fp16, zeros [N, G] int, g_idx [K]: groups of
    `group` consecutive columns of `order` (act-order: a permutation of the columns)."""
    n, k = w.shape
    order = torch.arange(k) if order is None else order
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    wp = w[:, order].float().reshape(n, k // group, group)
    if sym:
        scale = (wp.abs().amax(-1) / 7.5).clamp(min=1e-6)
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = wp.amin(-1).clamp(max=0), wp.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-6)
        zero = torch.round(-lo / scale).clamp(0, 15)
    scale = scale.half().float()
    q = torch.round(wp / scale[..., None] + zero[..., None]).clamp(0, 15)
    codes = torch.empty(n, k, dtype=torch.int32)
    codes[:, order] = q.reshape(n, k).to(torch.int32)
    return codes, scale.half(), zero.to(torch.int32), g_idx


def dequant_int4(codes, scales, zeros, g_idx) -> torch.Tensor:
    g = g_idx.long()
    return (codes.float() - zeros.float()[:, g]) * scales.float()[:, g]


def _pack_rows(values: torch.Tensor, order=range(8)) -> torch.Tensor:
    """[R, C] ints 0-15 -> [R, C / 8] int32 along the last dim, nibble i = column order[i]."""
    v = (values.to(torch.int64) & 15).reshape(values.shape[0], -1, 8)  # v1 zeros: -1 is 15
    word = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i, col in enumerate(order):
        word |= v[:, :, col] << (4 * i)
    return (word - ((word >> 31) << 32)).to(torch.int32)  # two's complement into int32


def pack_gptq(codes, scales, zeros, g_idx, v1: bool = True) -> dict[str, torch.Tensor]:
    """AutoGPTQ's layout: qweight [K / 8, N] packs 8 input channels, qzeros [G, N / 8] packs
    8 output channels (v1: the zero point minus 1), scales [G, N], g_idx [K]."""
    n, k = codes.shape
    return {
        "qweight": _pack_rows(codes.t().reshape(-1, 8, n).permute(0, 2, 1).reshape(-1, 8))
        .reshape(k // 8, n),
        "qzeros": _pack_rows(zeros.t() - (1 if v1 else 0)),
        "scales": scales.t().contiguous(),
        "g_idx": g_idx,
    }  # fmt: skip


def pack_awq(codes, scales, zeros) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout: qweight [K, N / 8] and qzeros [G, N / 8], 8 output channels per
    word in AWQ_PACK order; scales [G, N]."""
    return {
        "qweight": _pack_rows(codes.t().contiguous(), AWQ_PACK),
        "qzeros": _pack_rows(zeros.t().contiguous(), AWQ_PACK),
        "scales": scales.t().contiguous(),
    }


def fp8_quant(w: torch.Tensor, scheme: str, block: int = 32):
    """w [N, K] -> (e4m3 values, scale, scale's name suffix, dequantized); scheme "tensor",
    "channel" (weight_scale) or "block" (weight_scale_inv per block x block)."""
    n, k = w.shape
    if scheme == "tensor":
        s = (w.abs().amax() / 448).clamp(min=1e-8).reshape(())
        full = s.expand(n, k)
    elif scheme == "channel":
        s = (w.abs().amax(1, keepdim=True) / 448).clamp(min=1e-8)
        full = s.expand(n, k)
    else:
        nb, kb = -(-n // block), -(-k // block)
        pad = torch.zeros(nb * block, kb * block)
        pad[:n, :k] = w.abs()
        s = (pad.reshape(nb, block, kb, block).amax((1, 3)) / 448).clamp(min=1e-8)
        full = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    q = (w / full).to(torch.float8_e4m3fn)
    suffix = "_scale_inv" if scheme == "block" else "_scale"
    return q, s.float(), suffix, q.float() * full


def write_quantized(
    path: Path,
    method: str,
    *,
    moe: bool = False,
    group: int = 32,
    sym: bool = False,
    act_order: bool = False,
    scheme: str = "block",
    config_json: bool = True,
    v2: bool = False,
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny random HF model at `path` whose projections (experts too) are `method` ("gptq",
    "awq", "fp8"); returns the HF model holding the dequantized weights and those weights."""
    ref = save_random_hf(moe_config() if moe else dense_config(), path)
    tensors = _per_expert(load_file(path / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(3)
    for name, t in tensors.items():
        if not (any(p in name for p in PROJ) and name.endswith(".weight") and t.dim() == 2):
            out[name] = t
            continue
        base = name[: -len(".weight")]
        w = t.float()
        if method == "fp8":
            q, s, suffix, d = fp8_quant(w, scheme)
            out[name], out[name + suffix] = q, s
        else:
            order = torch.randperm(w.shape[1], generator=gen) if act_order else None
            g = w.shape[1] if group <= 0 else group
            codes, scales, zeros, g_idx = rtn_int4(w, g, sym, order)
            d = dequant_int4(codes, scales, zeros, g_idx)
            packed = pack_gptq(codes, scales, zeros, g_idx, not v2) if method == "gptq" else pack_awq(
                codes, scales, zeros)  # fmt: skip
            if method == "gptq" and not act_order and torch.rand(1, generator=gen) < 0.5:
                packed.pop("g_idx")  # some GPTQ checkpoints drop a trivial g_idx
            for part, v in packed.items():
                out[f"{base}.{part}"] = v
        deq[name] = d
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    if config_json:
        if method == "gptq":
            q = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym,
                 "desc_act": act_order,
                 "checkpoint_format": "gptq_v2" if v2 else "gptq"}  # fmt: skip
        elif method == "awq":
            q = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                 "version": "gemm"}  # fmt: skip
        elif scheme == "block":
            q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": [32, 32]}  # fmt: skip
        else:
            q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        config["quantization_config"] = q
    (path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        params = dict(ref.named_parameters())
        for name, d in deq.items():
            _set_hf(params, name, d)
    return ref, deq


def _per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused [E, ...] expert tensors -> one 2-D tensor per expert and projection,
    as GPTQ/AWQ/FP8 checkpoints store them."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".mlp.experts." in name and t.dim() == 3:
            prefix, kind = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                if kind == "down_proj":
                    out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
                else:
                    gate, up = t[e].chunk(2)
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                    out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
        else:
            out[name] = t
    return out


def _set_hf(params: dict[str, torch.nn.Parameter], name: str, d: torch.Tensor) -> None:
    """Put a dequantized per-expert or dense weight into the HF model (fused experts too)."""
    if name in params:
        params[name].copy_(d)
        return
    prefix, rest = name.split(".experts.")
    e, proj, _ = rest.split(".")
    if proj == "down_proj":
        params[f"{prefix}.experts.down_proj"][int(e)] = d
    else:
        rows = d.shape[0]
        off = 0 if proj == "gate_proj" else rows
        params[f"{prefix}.experts.gate_up_proj"][int(e), off : off + rows] = d


def random_int4(n: int, k: int, group: int, seed: int) -> Int4Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).half()
    zeros = torch.randint(0, 16, (n, k // group), generator=g).to(torch.uint8)
    return Int4Tensor("gptq", pack_codes(codes), scales, zeros, group)


def random_fp8(n: int, k: int, scheme: str, seed: int) -> Fp8Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    w[0, :7] = torch.tensor([0.0, 1e-6, -1e-6, 3e-4, -2e-5, 0.5, -0.5])  # subnormals and zero
    q, s, _, _ = fp8_quant(w, scheme, block=32)
    if scheme == "block":
        return Fp8Tensor(q, s, (32, 32))
    return Fp8Tensor(q, s.reshape(1, 1).expand(n, 1).contiguous() if s.dim() == 0 else s, (1, k))
