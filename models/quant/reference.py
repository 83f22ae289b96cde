"""Reference quantizers for the GGUF k-quant layouts Tandem serves packed (Q4_K, Q5_K, Q6_K):
plain min/max rounding, not llama.cpp's error-minimizing search. They exist to make valid
packed tensors of known content for tests and benchmarks; Q4_0/Q4_1/Q8_0 come from `gguf`'s
own quantizer (`quantize`)."""

from __future__ import annotations

import numpy as np


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> the 12-byte packing of Q4_K/Q5_K."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    hi = np.maximum(sub.max(-1), 0.0)
    qmax = (1 << bits) - 1
    scale, mn = (hi - lo) / qmax, -lo  # [n, 8]
    d = _f16(scale.max(-1) / 63)
    dmin = _f16(mn.max(-1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.where(df > 0, np.round(scale / np.where(df > 0, df, 1)), 0).clip(0, 63).astype(np.uint8)
    m = np.where(dminf > 0, np.round(mn / np.where(dminf > 0, dminf, 1)), 0)
    m = m.clip(0, 63).astype(np.uint8)
    s_eff = (df * sc)[..., None]
    m_eff = (dminf * m)[..., None]
    q = np.where(s_eff > 0, np.round((sub + m_eff) / np.where(s_eff > 0, s_eff, 1)), 0)
    q = q.clip(0, qmax).astype(np.uint8)  # [n, 8, 32]
    head = np.concatenate(
        [d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), _k_scales(sc, m)], 1
    )
    low = (q & 15).reshape(n, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    if bits == 4:
        return np.concatenate([head, qs], 1)
    qh = np.zeros((n, 32), np.uint8)
    for j in range(8):
        qh |= ((q[:, j] >> 4) & 1) << j
    return np.concatenate([head, qh, qs], 1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    s = np.abs(sub).max(-1) / 31  # [n, 16]
    d = _f16(s.max(-1) / 127)
    df = d.astype(np.float32)[:, None]
    sc = np.where(df > 0, np.round(s / np.where(df > 0, df, 1)), 0).clip(0, 127).astype(np.int8)
    s_eff = (df * sc)[..., None]
    q = np.where(s_eff > 0, np.round(sub / np.where(s_eff > 0, s_eff, 1)), 0).clip(-32, 31)
    q = (q + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # element h*128 + g*32 + l
    ql = np.empty((n, 2, 2, 32), np.uint8)
    ql[:, :, 0] = (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4)
    ql[:, :, 1] = (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)
    qh = (
        (q[:, :, 0] >> 4)
        | ((q[:, :, 1] >> 4) << 2)
        | ((q[:, :, 2] >> 4) << 4)
        | ((q[:, :, 3] >> 4) << 6)
    )
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.reshape(n, 1).view(np.uint8)],
        1,
    )


def quantize_k(values: np.ndarray, qtype: str) -> np.ndarray:
    """values [..., K] float (K a multiple of 256) -> packed [..., K / 256 * type_size] uint8."""
    x = np.ascontiguousarray(values, dtype=np.float32)
    if x.shape[-1] % 256:
        raise ValueError(f"{qtype} rows must be a multiple of 256 values, got {x.shape[-1]}")
    blocks = x.reshape(-1, 256)
    if qtype == "Q4_K":
        out = _q45_k(blocks, 4)
    elif qtype == "Q5_K":
        out = _q45_k(blocks, 5)
    elif qtype == "Q6_K":
        out = _q6_k(blocks)
    else:
        raise ValueError(f"quantize_k does not make {qtype}")
    return out.reshape(*x.shape[:-1], -1)
