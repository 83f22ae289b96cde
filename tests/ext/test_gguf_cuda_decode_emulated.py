"""The CUDA kernel's block decoding (ext/cuda/gguf_linear.cu, `decode_chunk`) compiled as C++
on the CPU with a shim for the device helpers, against models.gguf_dequant: the kernel's
unpacking is checked in the default suite, without a GPU."""

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

CU = Path(__file__).resolve().parents[2] / "ext" / "cuda" / "gguf_linear.cu"
SHIM = r"""
#include <immintrin.h>
#include <cstring>
#include <cstddef>
#define __device__
#define __forceinline__ inline
typedef unsigned short u16;
typedef unsigned int u32;
struct V16 { u32 x, y, z, w; };
inline V16 ldg16(const void* p) { V16 v; std::memcpy(&v, p, 16); return v; }
template <int DT> inline float ld_f(const u16* p) { return _cvtsh_ss(*p); }
"""
DRIVER = r"""
template <int QT> void run(const u8* data, int n, int k, long row_bytes, float* out) {
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < k / 32; ++c)
      decode_chunk<QT>(data + r * row_bytes, c, out + (size_t)r * k + c * 32);
}
extern "C" void decode(int qt, const u8* data, int n, int k, long row_bytes, float* out) {
  switch (qt) {
    case 2: run<2>(data, n, k, row_bytes, out); break;
    case 3: run<3>(data, n, k, row_bytes, out); break;
    case 8: run<8>(data, n, k, row_bytes, out); break;
    case 12: run<12>(data, n, k, row_bytes, out); break;
    case 13: run<13>(data, n, k, row_bytes, out); break;
    case 14: run<14>(data, n, k, row_bytes, out); break;
  }
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> ctypes.CDLL:
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None:
        pytest.skip("needs g++ on x86-64")
    src = CU.read_text()
    body = src[src.index("typedef unsigned char u8;") : src.index("// grid.x")]
    d = tmp_path_factory.mktemp("emu")
    (d / "emu.cpp").write_text(SHIM + body + DRIVER)
    subprocess.run(
        [
            "g++",
            "-O1",
            "-std=c++17",
            "-mf16c",
            "-shared",
            "-fPIC",
            str(d / "emu.cpp"),
            "-o",
            str(d / "emu.so"),
        ],
        check=True,
    )
    return ctypes.CDLL(str(d / "emu.so"))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_decode_chunk_equals_torch_reference(emulated: ctypes.CDLL, qtype: str) -> None:
    n, k = 7, 768
    w = np.random.default_rng(5).standard_normal((n, k)).astype(np.float32)
    data = np.ascontiguousarray(pack(w, qtype))
    q = QuantizedTensor(qtype, torch.from_numpy(data), k)
    out = np.zeros((n, k), np.float32)
    emulated.decode(
        q.type_id, data.ctypes.data_as(ctypes.c_void_p), n, k, ctypes.c_long(data.shape[1]),
        out.ctypes.data_as(ctypes.c_void_p),
    )  # fmt: skip
    np.testing.assert_array_equal(out, q.dequantize().numpy())
