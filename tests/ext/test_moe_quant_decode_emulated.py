"""The packed-expert kernels' chunk decoding (ext/cuda/moe_quant.cu, `qmoe_chunk`: Q4_0, Q8_0,
MXFP4, int4 and FP8 planes, the GGUF rows of the other types) compiled as C++ on the CPU with a
shim for the device helpers, against `PackedExperts.dequantize` (the torch reference): the
layouts the loader writes and the kernels read are checked in the default suite, no GPU."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.models.quant.experts import PackedExperts, expert_names
from tandem.models.quant.tensor import QuantizedTensor
from tests.models.hf_quant_cases import random_fp8, random_int4
from tests.models.quant_cases import pack

CUDA = Path(__file__).resolve().parents[2] / "ext" / "cuda"
SHIM = r"""
#include <immintrin.h>
#include <cstring>
#include <cstddef>
#define __device__
#define __forceinline__ inline
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
struct V16 { u32 x, y, z, w; };
inline V16 ldg16(const void* p) { V16 v; std::memcpy(&v, p, 16); return v; }
template <int DT> inline float ld_f(const u16* p) { return _cvtsh_ss(*p); }
inline float __uint_as_float(u32 u) { float f; std::memcpy(&f, &u, 4); return f; }
inline u32 __float_as_uint(float f) { u32 u; std::memcpy(&u, &f, 4); return u; }
"""
DRIVER = r"""
template <int QT> void run(const u8* q, const u8* sc, int n, int k, long rb, long srb, float* out) {
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < k / 32; ++c) {
      float* w = out + (size_t)r * k + c * 32;
      const float s = qmoe_chunk<QT>(q + r * rb, sc + r * srb, c, w);
      for (int i = 0; i < 32; ++i) w[i] *= s;
    }
}
extern "C" void decode(int qt, const u8* q, const u8* sc, int n, int k, long rb, long srb,
                       float* out) {
  switch (qt) {
    case 2: run<2>(q, sc, n, k, rb, srb, out); break;
    case 8: run<8>(q, sc, n, k, rb, srb, out); break;
    case 39: run<39>(q, sc, n, k, rb, srb, out); break;
    case 12: run<12>(q, sc, n, k, rb, srb, out); break;
    case 14: run<14>(q, sc, n, k, rb, srb, out); break;
    case 1032: run<1032>(q, sc, n, k, rb, srb, out); break;
    case 1128: run<1128>(q, sc, n, k, rb, srb, out); break;
    case 2032: run<2032>(q, sc, n, k, rb, srb, out); break;
  }
}
"""


def _between(text: str, start: str, end: str) -> str:
    return text[text.index(start) : text.index(end)]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> ctypes.CDLL:
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None:
        pytest.skip("needs g++ on x86-64")
    gguf = _between((CUDA / "gguf_linear.cu").read_text(), "typedef unsigned char u8;", "// grid.x")
    hf = (CUDA / "hf_linear.cu").read_text()
    hf = _between(hf, "// The float q - bias", "#ifndef HF_LINEAR_DECODE_ONLY")
    moe = (CUDA / "moe_quant.cu").read_text()
    moe = _between(moe, "// An e2m1 nibble", "// R rows' dot products")
    d = tmp_path_factory.mktemp("emu")
    (d / "emu.cpp").write_text(SHIM + gguf + hf + moe + DRIVER)
    cmd = ["g++", "-O1", "-std=c++17", "-mf16c", "-shared", "-fPIC", str(d / "emu.cpp"), "-o"]
    subprocess.run([*cmd, str(d / "emu.so")], check=True)
    return ctypes.CDLL(str(d / "emu.so"))


def _experts(kind: str, hidden: int, inter: int) -> PackedExperts:
    qtype = kind.split("-")[0]
    experts = PackedExperts(expert_names("l.", 0, 2), qtype, hidden, inter)
    rng = np.random.default_rng(3)
    for i in range(6):
        rows, cols = (hidden, inter) if i % 3 == 2 else (inter, hidden)
        if qtype == "int4":
            experts.set_part(i, random_int4(rows, cols, int(kind[6:]), i))
        elif qtype == "fp8":
            experts.set_part(i, random_fp8(rows, cols, "block", i))
        else:
            w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.1
            data = torch.from_numpy(np.ascontiguousarray(pack(w, qtype))).reshape(rows, -1)
            experts.set_part(i, QuantizedTensor(qtype, data, cols))
    return experts


@pytest.mark.parametrize(
    "kind", ["Q4_0", "Q8_0", "MXFP4", "Q4_K", "Q6_K", "int4-g32", "int4-g128", "fp8-b32"]
)
def test_chunks_equal_the_packed_experts_reference(emulated: ctypes.CDLL, kind: str) -> None:
    hidden, inter = 512, 256
    experts = _experts(kind, hidden, inter)
    w13, w2 = experts.dequantize(torch.float32)
    for data, scales, ref in ((experts.data13, experts.scales13, w13),
                              (experts.data2, experts.scales2, w2)):  # fmt: skip
        e, n, rb = data.shape
        k = ref.shape[2]
        codes = data.reshape(e * n, rb).contiguous().numpy()
        sc = np.zeros((e * n, 1), np.uint8) if scales is None else scales.reshape(e * n, -1)
        sc = np.ascontiguousarray(sc if isinstance(sc, np.ndarray) else sc.numpy())
        out = np.zeros((e * n, k), np.float32)
        emulated.decode(
            experts.type_id, codes.ctypes.data_as(ctypes.c_void_p),
            sc.ctypes.data_as(ctypes.c_void_p), e * n, k, ctypes.c_long(rb),
            ctypes.c_long(sc.shape[1] if scales is not None else 0),
            out.ctypes.data_as(ctypes.c_void_p),
        )  # fmt: skip
        np.testing.assert_array_equal(out, ref.reshape(e * n, k).numpy())
