// GPTQ/AWQ int4 and FP8 e4m3 weights on CUDA, in the serving layouts of models/quant/int4.py
// and fp8.py: y[M, N] = x[M, K] @ W[N, K]^T, fp32 accumulation.
// *_gemv_kernel: decode-sized M (one warp per weight row, each lane a 32-value chunk at a time,
// so the row's bytes are read once for all M rows of x; the chunk's unscaled values are summed
// against x and the sum scaled once). *_dequant_kernel: the matrix into a
// 16-bit scratch buffer for a cuBLAS GEMM at prefill sizes. decode_* are plain functions of the
// loaded words (tests/ext compiles them on the CPU against the torch reference).
#include "common.cuh"

typedef unsigned char u8;

// The float q - bias for a small integer q: 2^23 + q has q as its mantissa bits, so one OR and
// one subtraction replace an int-to-float conversion (quarter rate); exact for |q - z| < 2^23.
__device__ __forceinline__ float int_minus(u32 q, float bias_2p23) {
  return __uint_as_float(0x4B000000u | q) - bias_2p23;
}

// int4 chunk: 16 bytes (4 words), byte i holds value i (low nibble) and i + 16 (high);
// w = s * (q - z) (s = 1: the codes minus the zero point, the GEMV scales the sum).
__device__ __forceinline__ void decode_int4_chunk(const u32* q, float s, float z, float* w) {
  const float bias = 8388608.f + z;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const u32 b = q[i >> 2] >> (8 * (i & 3));
    w[i] = int_minus(b & 15u, bias) * s;
    w[i + 16] = int_minus((b >> 4) & 15u, bias) * s;
  }
}

// One e4m3 byte -> float, exactly: normals by moving exponent and mantissa into fp32's
// fields (bias 7 -> 127), subnormals as m * 2^-9. (0x7f / 0xff, NaN, never occur in weights.)
__device__ __forceinline__ float e4m3_to_float(u32 b) {
  const u32 mag = b & 0x7Fu;
  const float sub = int_minus(mag, 8388608.f) * 0.001953125f;
  const float v = mag < 8u ? sub : __uint_as_float((mag << 20) + (120u << 23));
  return __uint_as_float(__float_as_uint(v) | ((b & 0x80u) << 24));
}

// fp8 chunk: 32 bytes (8 words) in order; w = value * s.
__device__ __forceinline__ void decode_fp8_chunk(const u32* q, float s, float* w) {
#pragma unroll
  for (int i = 0; i < 32; ++i) w[i] = e4m3_to_float((q[i >> 2] >> (8 * (i & 3))) & 255u) * s;
}

#ifndef HF_LINEAR_DECODE_ONLY
// Chunk c of row r -> its 32 values before the scale, in w, and the scale it shares
// (F: 0 int4, 1 fp8; SDT: the int4 scales' type, fp16 or bf16).
template <int F, int SDT>
__device__ __forceinline__ float load_chunk(const u8* __restrict__ wq, const void* __restrict__ sc,
                                            const u8* __restrict__ zp, int r, int c, int K, int g0,
                                            int g1, int scols, float* w) {
  if constexpr (F == 0) {  // g0: group size
    const V16 v = ldg16(wq + (size_t)r * (K >> 1) + c * 16);
    const u32 q[4] = {v.x, v.y, v.z, v.w};
    const size_t gi = (size_t)r * (K / g0) + (c * 32) / g0;
    decode_int4_chunk(q, 1.f, (float)zp[gi], w);
    return ld_f<SDT>((const u16*)sc + gi);
  } else {  // g0 x g1: scale block
    const u8* p = wq + (size_t)r * K + c * 32;
    const V16 a = ldg16(p), b = ldg16(p + 16);
    const u32 q[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    decode_fp8_chunk(q, 1.f, w);
    return ((const float*)sc)[(size_t)(r / g0) * scols + (c * 32) / g1];
  }
}

// grid.x * 8 warps cover the N rows; x [M][K] (row stride ldx), out [M][N] (row stride ldo).
template <int F, int SDT, int M, int DT>
__global__ void __launch_bounds__(256) hf_gemv_kernel(const u16* __restrict__ x,
                                                      const u8* __restrict__ wq,
                                                      const void* __restrict__ sc,
                                                      const u8* __restrict__ zp,
                                                      u16* __restrict__ out, int N, int K, int g0,
                                                      int g1, int scols, i64 ldx, i64 ldo) {
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (r >= N) return;
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  const int chunks = K >> 5;
  for (int c = lane; c < chunks; c += 32) {
    float wv[32];
    const float scale = load_chunk<F, SDT>(wq, sc, zp, r, c, K, g0, g1, scols, wv);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const u16* xp = x + (size_t)m * ldx + c * 32;
      float s = 0.f;
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        float xf[8];
        unpack8<DT>(ldg16(xp + v * 8), xf);
#pragma unroll
        for (int i = 0; i < 8; ++i) s = fmaf(wv[v * 8 + i], xf[i], s);
      }
      acc[m] = fmaf(scale, s, acc[m]);
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float v = acc[m];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) out[(size_t)m * ldo + r] = from_float<DT>(v);
  }
}

// One thread per (row, 32-value chunk): out [N][K] 16-bit.
template <int F, int SDT, int DT>
__global__ void __launch_bounds__(256) hf_dequant_kernel(const u8* __restrict__ wq,
                                                         const void* __restrict__ sc,
                                                         const u8* __restrict__ zp,
                                                         u16* __restrict__ out, int N, int K,
                                                         int g0, int g1, int scols) {
  const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const int chunks = K >> 5;
  if (t >= (i64)N * chunks) return;
  const int r = (int)(t / chunks), c = (int)(t % chunks);
  float wv[32];
  const float scale = load_chunk<F, SDT>(wq, sc, zp, r, c, K, g0, g1, scols, wv);
#pragma unroll
  for (int i = 0; i < 32; ++i) wv[i] *= scale;  // the reference's (q - z) * s, value * s
  u16* o = out + (size_t)r * K + c * 32;
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    V16 p;
    p.x = pack2<DT>(wv[v * 8 + 0], wv[v * 8 + 1]);
    p.y = pack2<DT>(wv[v * 8 + 2], wv[v * 8 + 3]);
    p.z = pack2<DT>(wv[v * 8 + 4], wv[v * 8 + 5]);
    p.w = pack2<DT>(wv[v * 8 + 6], wv[v * 8 + 7]);
    stg16(o + v * 8, p);
  }
}
#endif
