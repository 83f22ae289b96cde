"""ext/cuda/gguf_tile.cu's dequantizer (the prefill path, and the scale decoding the GEMV shares)
compiled as C++ on the CPU with a shim for the device helpers, run over every thread of its
grid, against models.gguf_dequant in fp16, bit for bit: checked in the default suite."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.models.quant.tensor import QuantizedTensor
from tests.models.quant_cases import pack

CU = Path(__file__).resolve().parents[2] / "ext" / "cuda" / "gguf_tile.cu"
SHIM = r"""
#include <immintrin.h>
#include <cstring>
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
struct V16 { u32 x, y, z, w; };
inline V16 ldg16(const void* p) { V16 v; std::memcpy(&v, p, 16); return v; }
inline void stg16(void* p, const V16& v) { std::memcpy(p, &v, 16); }
template <int DT> inline void unpack2(u32 w, float& lo, float& hi) {
  lo = _cvtsh_ss(w & 0xffffu); hi = _cvtsh_ss(w >> 16);
}
template <int DT> inline u32 pack2(float lo, float hi) {
  return (u32)_cvtss_sh(lo, 0) | ((u32)_cvtss_sh(hi, 0) << 16);
}
inline float __uint_as_float(u32 u) { float f; std::memcpy(&f, &u, 4); return f; }
struct Dim { unsigned x; };
static Dim blockIdx, threadIdx, blockDim;
"""
DRIVER = r"""
template <int QT> void run(const u8* w, int n, int k, u16* out) {
  const long total = (long)(n / 16) * (k / 64) * 32;
  blockDim.x = 256;
  for (long id = 0; id < (total + 255) / 256 * 256; ++id) {
    blockIdx.x = (unsigned)(id / 256);
    threadIdx.x = (unsigned)(id % 256);
    gguf_tile_dequant_kernel<QT, 0>(w, out, n, k);
  }
}
extern "C" void dequant(int qt, const u8* w, int n, int k, u16* out) {
  switch (qt) {
    case 2: run<2>(w, n, k, out); break;
    case 3: run<3>(w, n, k, out); break;
    case 12: run<12>(w, n, k, out); break;
  }
}
"""
LDG8_ASM = 'asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));'


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> ctypes.CDLL:
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None:
        pytest.skip("needs g++ on x86-64")
    src = CU.read_text()
    assert LDG8_ASM in src
    src = src.replace(LDG8_ASM, "std::memcpy(&r, p, 8);")
    body = src[src.index("typedef unsigned char u8;") : src.index("// Everything one warp reads")]
    body += src[src.index("// One thread per (tile, chunk, lane)") :]
    d = tmp_path_factory.mktemp("emu_tile")
    (d / "emu.cpp").write_text(SHIM + body + DRIVER)
    cmd = ["g++", "-O1", "-std=c++17", "-mf16c", "-shared", "-fPIC", str(d / "emu.cpp")]
    subprocess.run([*cmd, "-o", str(d / "emu.so")], check=True)
    return ctypes.CDLL(str(d / "emu.so"))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_tile_dequantizer_equals_torch_reference(emulated: ctypes.CDLL, qtype: str) -> None:
    n, k = 48, 768
    w = np.random.default_rng(3).standard_normal((n, k)).astype(np.float32)
    q = QuantizedTensor(qtype, torch.from_numpy(np.ascontiguousarray(pack(w, qtype))), k)
    tiles = np.ascontiguousarray(q.as_tiles().data.numpy())
    out = np.zeros((n, k), np.float16)
    emulated.dequant(
        q.type_id, tiles.ctypes.data_as(ctypes.c_void_p), n, k, out.ctypes.data_as(ctypes.c_void_p)
    )
    np.testing.assert_array_equal(out, q.dequantize(torch.float16).numpy())
