// Portable kernel for GGUF-packed weights: fp32 activations, each 32-value chunk decoded to
// (code * scale) values plus one min, in the block layouts of models/gguf_dequant.py.
#include <cmath>
#include <cstring>

#include "qlinear.h"

namespace tandem_cpu {
namespace {

float f16(const uint8_t* p) {  // IEEE half -> float, exact (subnormals included)
  uint16_t h;
  std::memcpy(&h, p, 2);
  const int e = (h >> 10) & 31, m = h & 1023;
  const float v = e == 0 ? std::ldexp((float)m, -24)
                  : e == 31 ? (m ? NAN : INFINITY)
                            : std::ldexp((float)(m | 1024), e - 25);
  return (h & 0x8000) ? -v : v;
}

void k_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Chunk c (32 values) of a row: w[i] = code * scale (the float the reference forms first);
// returns the chunk's additive min (value = w + min).
float chunk(int qt, const uint8_t* row, int c, float* w) {
  if (qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q8_0) {
    const int bytes = qtype_block_bytes(qt);
    const uint8_t* b = row + (size_t)c * bytes;
    const float d = f16(b);
    if (qt == QT_Q8_0) {
      for (int i = 0; i < 32; ++i) w[i] = d * (float)(int8_t)b[2 + i];
      return 0.f;
    }
    const uint8_t* qs = b + (qt == QT_Q4_0 ? 2 : 4);
    for (int i = 0; i < 16; ++i) {
      const float lo = (float)(qs[i] & 15), hi = (float)(qs[i] >> 4);
      w[i] = qt == QT_Q4_0 ? d * (lo - 8.f) : d * lo;
      w[i + 16] = qt == QT_Q4_0 ? d * (hi - 8.f) : d * hi;
    }
    return qt == QT_Q4_0 ? 0.f : f16(b + 2);
  }
  const uint8_t* b = row + (size_t)(c / 8) * qtype_block_bytes(qt);
  const int j = c % 8;
  if (qt == QT_Q6_K) {
    const float d = f16(b + 208);
    const int h = j / 4, g = j % 4;
    const uint8_t* ql = b + h * 64 + (g & 1) * 32;
    const uint8_t* qh = b + 128 + h * 32;
    for (int l = 0; l < 32; ++l) {
      const int nib = (g >> 1) ? (ql[l] >> 4) : (ql[l] & 15);
      const int q = (nib | (((qh[l] >> (2 * g)) & 3) << 4)) - 32;
      const float s = d * (float)(int8_t)b[192 + 2 * j + l / 16];
      w[l] = s * (float)q;
    }
    return 0.f;
  }
  int sc, mn;
  k_scale_min(b + 4, j, &sc, &mn);
  const float ds = f16(b) * (float)sc, dm = f16(b + 2) * (float)mn;
  const uint8_t* qs = b + (qt == QT_Q4_K ? 16 : 48) + (j / 2) * 32;
  for (int l = 0; l < 32; ++l) {
    int q = (j & 1) ? (qs[l] >> 4) : (qs[l] & 15);
    if (qt == QT_Q5_K) q |= ((b[16 + l] >> j) & 1) << 4;
    w[l] = ds * (float)q;
  }
  return -dm;
}

size_t prep_bytes(int K, int M) { return (size_t)M * (K + K / 32) * sizeof(float); }

void prep(const void* x, bool x_bf16, int M, int K, void* dst) {
  float* d = (float*)dst;
  float* sums = d + (size_t)M * K;
  for (int t = 0; t < M; ++t) {
    for (int k = 0; k < K; ++k)
      d[(size_t)t * K + k] = x_bf16 ? bf16_to_f32(((const uint16_t*)x)[(size_t)t * K + k])
                                    : ((const float*)x)[(size_t)t * K + k];
    for (int c = 0; c < K / 32; ++c) {
      float s = 0.f;
      for (int i = 0; i < 32; ++i) s += d[(size_t)t * K + c * 32 + i];
      sums[(size_t)t * (K / 32) + c] = s;
    }
  }
}

void rows(const QLinearArgs& a, const void* xp, int r0, int r1) {
  const float* X = (const float*)xp;
  const float* S = X + (size_t)a.M * a.K;
  const int chunks = a.K / 32;
  float w[32];
  for (int r = r0; r < r1; ++r) {
    const uint8_t* row = a.w + (size_t)r * a.row_bytes;
    for (int t = 0; t < a.M; ++t) {
      float acc = 0.f;
      for (int c = 0; c < chunks; ++c) {
        const float mn = chunk(a.qtype, row, c, w);
        const float* x = X + (size_t)t * a.K + c * 32;
        float s = 0.f;
        for (int i = 0; i < 32; ++i) s = std::fma(w[i], x[i], s);
        acc += s + mn * S[(size_t)t * chunks + c];
      }
      qlinear_store(a, t, r, acc);
    }
  }
}

}  // namespace

QLinearKernels qlinear_kernels_scalar() { return {"scalar", prep_bytes, prep, rows}; }

}  // namespace tandem_cpu
