"""The CUDA kernels' decoding of GPTQ/AWQ int4 chunks and FP8 e4m3 bytes (ext/cuda/hf_linear.cu,
`decode_int4_chunk`, `decode_fp8_chunk`) compiled as C++ on the CPU with a shim for the device
helpers, against the tensors' torch dequantization: checked in the default suite, no GPU."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models.hf_quant_cases import random_fp8, random_int4

CU = Path(__file__).resolve().parents[2] / "ext" / "cuda" / "hf_linear.cu"
SHIM = r"""
#include <cstring>
#define __device__
#define __forceinline__ inline
#define HF_LINEAR_DECODE_ONLY
typedef unsigned int u32;
inline float __uint_as_float(u32 u) { float f; std::memcpy(&f, &u, 4); return f; }
inline u32 __float_as_uint(float f) { u32 u; std::memcpy(&u, &f, 4); return u; }
"""
DRIVER = r"""
// Rows as the kernel reads them: words of each 32-value chunk, one scale (and zero) per chunk.
extern "C" void int4(const u8* codes, const float* s, const float* z, int n, int k, float* out) {
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < k / 32; ++c) {
      u32 q[4];
      std::memcpy(q, codes + (size_t)r * (k / 2) + c * 16, 16);
      const int i = r * (k / 32) + c;
      decode_int4_chunk(q, s[i], z[i], out + (size_t)r * k + c * 32);
    }
}
extern "C" void fp8(const u8* data, const float* s, int n, int k, float* out) {
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < k / 32; ++c) {
      u32 q[8];
      std::memcpy(q, data + (size_t)r * k + c * 32, 32);
      decode_fp8_chunk(q, s[r * (k / 32) + c], out + (size_t)r * k + c * 32);
    }
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> ctypes.CDLL:
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None:
        pytest.skip("needs g++ on x86-64")
    src = CU.read_text()
    body = src[src.index("typedef unsigned char u8;") : src.index("#ifndef HF_LINEAR_DECODE_ONLY")]
    d = tmp_path_factory.mktemp("emu")
    (d / "emu.cpp").write_text(SHIM + body + DRIVER)
    cmd = ["g++", "-O1", "-std=c++17", "-shared", "-fPIC", str(d / "emu.cpp"), "-o"]
    subprocess.run([*cmd, str(d / "emu.so")], check=True)
    return ctypes.CDLL(str(d / "emu.so"))


def _p(a: np.ndarray) -> ctypes.c_void_p:
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.parametrize("group", [32, 64, 160])
def test_int4_chunks_equal_torch_reference(emulated: ctypes.CDLL, group: int) -> None:
    n, k = 7, 320 if group != 160 else 480
    w = random_int4(n, k, group, group)
    per = group // 32
    s = w.scales.float().repeat_interleave(per, 1).contiguous().numpy()
    z = w.zeros.float().repeat_interleave(per, 1).contiguous().numpy()
    codes = w.codes.contiguous().numpy()
    out = np.zeros((n, k), np.float32)
    emulated.int4(_p(codes), _p(s), _p(z), n, k, _p(out))
    np.testing.assert_array_equal(out, w.dequantize_stored().numpy())


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_fp8_chunks_equal_torch_reference(emulated: ctypes.CDLL, scheme: str) -> None:
    n, k = 45, 160
    w = random_fp8(n, k, scheme, 3)
    br, bc = w.block
    s = w.scale.repeat_interleave(br, 0)[:n]
    s = s.repeat_interleave(max(bc // 32, 1), 1)[:, : k // 32].contiguous().numpy()
    data = w.data.view(torch.uint8).contiguous().numpy()
    out = np.zeros((n, k), np.float32)
    emulated.fp8(_p(data), _p(s), n, k, _p(out))
    np.testing.assert_array_equal(out, w.dequantize().numpy())
