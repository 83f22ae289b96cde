// GPTQ/AWQ int4 and FP8 e4m3 weights on CUDA, in the serving layouts of models/quant/int4.py
// and fp8.py: y[M, N] = x[M, K] @ W[N, K]^T, fp32 accumulation.
// *_gemv_kernel: decode-sized M (one warp per weight row, each lane a 32-value chunk at a time,
// so the row's bytes are read once for all M rows of x; the chunk's unscaled values are summed
// against x and the sum scaled once). hf_mma_kernel: mid-size M (up to 32 rows a pass) through
// m16n8k16 tensor-core MMAs, weight fragments decoded in registers. *_dequant_kernel: the matrix into a
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

// ---- tensor-core path ----------------------------------------------------------------------
// A 128-column chunk of 16 weight rows per warp and MMA step. Lane (g, t) reads rows g and g + 8
// at columns 32t..32t+31 (int4: one 16-byte GPTQ sub-chunk; fp8: 32 bytes) and x's rows at the
// same columns: the MMA's k order is permuted identically on both sides (pair p of the lane =
// columns 32t + 2p, 2p + 1; k-tile kt takes pairs 2kt and 2kt + 1), so no shuffles are needed.
// Codes become exact 16-bit values (int4: q - z; fp8: the e4m3 value) and the fp32 scale
// multiplies each chunk's partial sums, as the GEMV does.

// int4: the 16-bit pair (q - z) of pair p (< 8: low nibbles of bytes 2p, 2p + 1; else high
// nibbles of bytes 2p - 16, 2p - 15) of the lane's 4 words; negz = -(magic + z) in both halves.
template <int DT>
__device__ __forceinline__ u32 int4_pair(const u32* w, int p, u32 negz) {
  const int b = p & 7;
  u32 v = __byte_perm(w[b >> 1], 0u, (b & 1) ? 0x4342u : 0x4140u);
  if (p >= 8) v >>= 4;
  v = (v & 0x000F000Fu) | (DT == 1 ? 0x43004300u : 0x64006400u);
  u32 r;
  if constexpr (DT == 1) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x3F803F80u), "r"(negz));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x3C003C00u), "r"(negz));
  }
  return r;
}

template <int DT>
__device__ __forceinline__ u32 int4_negz(float z) {
  const u32 h = (DT == 1 ? 0x4300u : 0x6400u) + (u32)z;  // magic + z: exact (ulp 1)
  return (h | 0x8000u) * 0x00010001u;
}

// fp8: the 16-bit pair of bytes 2p, 2p + 1 of the lane's 8 words, exactly: the magnitude's bits
// placed under the 16-bit type's exponent (the value times 2^-120 in bf16, 2^-8 in fp16,
// subnormals included), then one multiply by 2^120 / 2^8.
template <int DT>
__device__ __forceinline__ u32 fp8_pair(const u32* w, int p) {
  const u32 v = __byte_perm(w[p >> 1], 0u, (p & 1) ? 0x4342u : 0x4140u);
  const u32 sign = (v & 0x00800080u) << 8;
  u32 r;
  if constexpr (DT == 1) {
    const u32 a = ((v & 0x007F007Fu) << 4) | sign;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(0x7B807B80u), "r"(0x80008000u));
  } else {
    const u32 a = ((v & 0x007F007Fu) << 7) | sign;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(0x5C005C00u), "r"(0x80008000u));
  }
  return r;
}

template <int F>
struct MmaRows {  // one tile's rows g and g + 8 for one chunk: raw words and scale (and zero)
  u32 w[2][F == 0 ? 4 : 8];
  float s[2], z[2];
};

template <int F, int SDT>
__device__ __forceinline__ void load_mma_rows(MmaRows<F>& L, const u8* __restrict__ wq,
                                              const void* __restrict__ sc,
                                              const u8* __restrict__ zp, int row0, int N, int c,
                                              int K, int g0, int g1, int scols, int t) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + 8 * h;
    if (r >= N) {
#pragma unroll
      for (int i = 0; i < (F == 0 ? 4 : 8); ++i) L.w[h][i] = 0u;
      L.s[h] = 0.f, L.z[h] = 0.f;
      continue;
    }
    if constexpr (F == 0) {
      const V16 v = ldg16(wq + (size_t)r * (K >> 1) + c * 64 + t * 16);
      L.w[h][0] = v.x, L.w[h][1] = v.y, L.w[h][2] = v.z, L.w[h][3] = v.w;
      const size_t gi = (size_t)r * (K / g0) + (c * 128) / g0;
      L.s[h] = ld_f<SDT>((const u16*)sc + gi);
      L.z[h] = (float)zp[gi];
    } else {
      const u8* p = wq + (size_t)r * K + c * 128 + t * 32;
      const V16 a = ldg16(p), b = ldg16(p + 16);
      L.w[h][0] = a.x, L.w[h][1] = a.y, L.w[h][2] = a.z, L.w[h][3] = a.w;
      L.w[h][4] = b.x, L.w[h][5] = b.y, L.w[h][6] = b.z, L.w[h][7] = b.w;
      L.s[h] = ((const float*)sc)[(size_t)(r / g0) * scols + (c * 128) / g1];
      L.z[h] = 0.f;
    }
  }
}

// grid.x = ceil(N / (16 R)): R tiles of 16 rows per CTA; its W warps take chunks w, w + W, ...
// of all R tiles and sum through shared memory. x [M][K] with M <= 8 MT (row stride ldx), out
// [M][N] (ldo). Needs K % 128 == 0 and one scale per row per chunk (int4 group % 128 == 0,
// fp8 block columns % 128 == 0).
template <int F, int SDT, int MT, int DT, int R, int W>
__global__ void __launch_bounds__(W * 32) hf_mma_kernel(const u16* __restrict__ x,
                                                      const u8* __restrict__ wq,
                                                      const void* __restrict__ sc,
                                                      const u8* __restrict__ zp,
                                                      u16* __restrict__ out, int M, int N, int K,
                                                      int g0, int g1, int scols, i64 ldx,
                                                      i64 ldo) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int chunks = K >> 7;
  const int n0 = blockIdx.x * R * 16;
  float acc[R][MT][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < MT; ++j) acc[r][j][0] = acc[r][j][1] = acc[r][j][2] = acc[r][j][3] = 0.f;

  MmaRows<F> L[R];
  if (warp < chunks)
#pragma unroll
    for (int r = 0; r < R; ++r)
      load_mma_rows<F, SDT>(L[r], wq, sc, zp, n0 + 16 * r + g, N, warp, K, g0, g1, scols, t);
  pdl_wait();
  pdl_trigger();
  for (int c = warp; c < chunks; c += W) {
    MmaRows<F> cur[R];
#pragma unroll
    for (int r = 0; r < R; ++r) cur[r] = L[r];
    if (c + W < chunks)
#pragma unroll
      for (int r = 0; r < R; ++r)
        load_mma_rows<F, SDT>(L[r], wq, sc, zp, n0 + 16 * r + g, N, c + W, K, g0, g1, scols, t);
    u32 negz[R][2];
    if constexpr (F == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) negz[r][0] = int4_negz<DT>(cur[r].z[0]), negz[r][1] = int4_negz<DT>(cur[r].z[1]);
    }
    float part[R][MT][4];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < MT; ++j) part[r][j][0] = part[r][j][1] = part[r][j][2] = part[r][j][3] = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      V16 xq[MT];
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        const int xr = 8 * j + g;
        if (xr < M) {
          xq[j] = ldg16(x + (i64)xr * ldx + c * 128 + t * 32 + q * 8);
        } else {
          xq[j].x = xq[j].y = xq[j].z = xq[j].w = 0u;
        }
      }
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        const int p0 = 4 * q + 2 * kk;  // pairs p0 (k 2t, 2t+1) and p0 + 1 (k 2t+8, 2t+9)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          u32 a[4];
          if constexpr (F == 0) {
            a[0] = int4_pair<DT>(cur[r].w[0], p0, negz[r][0]);
            a[1] = int4_pair<DT>(cur[r].w[1], p0, negz[r][1]);
            a[2] = int4_pair<DT>(cur[r].w[0], p0 + 1, negz[r][0]);
            a[3] = int4_pair<DT>(cur[r].w[1], p0 + 1, negz[r][1]);
          } else {
            a[0] = fp8_pair<DT>(cur[r].w[0], p0);
            a[1] = fp8_pair<DT>(cur[r].w[1], p0);
            a[2] = fp8_pair<DT>(cur[r].w[0], p0 + 1);
            a[3] = fp8_pair<DT>(cur[r].w[1], p0 + 1);
          }
#pragma unroll
          for (int j = 0; j < MT; ++j) {
            const u32 b0 = kk ? xq[j].z : xq[j].x, b1 = kk ? xq[j].w : xq[j].y;
            mma16816<DT>(part[r][j], a, b0, b1);
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[r][j][i] = fmaf(cur[r].s[i >> 1], part[r][j][i], acc[r][j][i]);
  }

  __shared__ float red[W][R * MT * 4][32];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][(r * MT + j) * 4 + i][lane] = acc[r][j][i];
  __syncthreads();
  if (warp >= R) return;
  const int r = warp;
#pragma unroll
  for (int j = 0; j < MT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float v = 0.f;
#pragma unroll
      for (int w2 = 0; w2 < W; ++w2) v += red[w2][(r * MT + j) * 4 + i][lane];
      const int xr = 8 * j + 2 * t + (i & 1), wr = n0 + 16 * r + g + 8 * (i >> 1);
      if (xr < M && wr < N) out[(i64)xr * ldo + wr] = from_float<DT>(v);
    }
}
#endif
