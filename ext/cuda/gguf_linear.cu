// GGUF-packed weights on CUDA: y[M, N] = x[M, K] @ W[N, K]^T with W in its own block layout
// (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; ggml type ids as QT), dequantized in registers with the
// same float operations as models/gguf_dequant.py, fp32 accumulation.
// gguf_gemv_kernel: decode-sized M (one warp per weight row, each lane a 32-value chunk at a
// time, so the row's bytes are read once for all M rows of x). gguf_dequant_kernel: the whole
// matrix into a 16-bit scratch buffer, for a cuBLAS GEMM at prefill sizes.
#include "common.cuh"

typedef unsigned char u8;

__device__ __forceinline__ float h2f(const u8* p) {
  return ld_f<0>((const u16*)p);  // fp16 bits (2-byte aligned in every block layout)
}

__device__ __forceinline__ int block_bytes(int qt) {
  return qt == 2 ? 18 : qt == 3 ? 20 : qt == 8 ? 34 : qt == 12 ? 144 : qt == 13 ? 176 : 210;
}

// 32 bytes at p as 8 words, with the widest loads the layout's alignment allows (A: bytes).
template <int A>
__device__ __forceinline__ void load32(const u8* p, u32* w) {
  if constexpr (A == 16) {
    const V16 a = ldg16(p), b = ldg16(p + 16);
    w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
  } else if constexpr (A == 4) {
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = ((const u32*)p)[i];
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = (u32)((const u16*)p)[2 * i] | ((u32)((const u16*)p)[2 * i + 1] << 16);
  }
}

__device__ __forceinline__ u32 byte_of(const u32* w, int i) { return (w[i >> 2] >> (8 * (i & 3))) & 255u; }

// Chunk c (32 values) of a packed row -> w[32] floats, as the torch reference forms them.
template <int QT>
__device__ __forceinline__ void decode_chunk(const u8* row, int c, float* w) {
  if constexpr (QT == 2 || QT == 3 || QT == 8) {
    const u8* b = row + (size_t)c * block_bytes(QT);
    const float d = h2f(b);
    u32 q[8];
    if constexpr (QT == 8) {
      load32<2>(b + 2, q);
#pragma unroll
      for (int i = 0; i < 32; ++i) w[i] = (float)(signed char)byte_of(q, i) * d;
    } else {
      if constexpr (QT == 2) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
          q[i] = (u32)((const u16*)(b + 2))[2 * i] | ((u32)((const u16*)(b + 2))[2 * i + 1] << 16);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) q[i] = ((const u32*)(b + 4))[i];
      }
      const float m = QT == 3 ? h2f(b + 2) : 0.f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const u32 v = byte_of(q, i);
        if constexpr (QT == 2) {
          w[i] = d * ((float)(v & 15) - 8.f);
          w[i + 16] = d * ((float)(v >> 4) - 8.f);
        } else {
          w[i] = d * (float)(v & 15) + m;
          w[i + 16] = d * (float)(v >> 4) + m;
        }
      }
    }
  } else {
    const u8* b = row + (size_t)(c >> 3) * block_bytes(QT);
    const int j = c & 7;
    if constexpr (QT == 14) {
      const float d = h2f(b + 208);
      const int h = j >> 2, g = j & 3;
      u32 ql[8], qh[8];
      load32<2>(b + h * 64 + (g & 1) * 32, ql);
      load32<2>(b + 128 + h * 32, qh);
      const float s0 = d * (float)(signed char)b[192 + 2 * j];
      const float s1 = d * (float)(signed char)b[192 + 2 * j + 1];
#pragma unroll
      for (int l = 0; l < 32; ++l) {
        const u32 lb = byte_of(ql, l);
        const int nib = (g >> 1) ? (lb >> 4) : (lb & 15);
        const int q = (nib | (((byte_of(qh, l) >> (2 * g)) & 3) << 4)) - 32;
        w[l] = (l < 16 ? s0 : s1) * (float)q;
      }
    } else {
      const u8* s = b + 4;
      int sc, mn;
      if (j < 4) {
        sc = s[j] & 63;
        mn = s[j + 4] & 63;
      } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
      }
      const float ds = h2f(b) * (float)sc, dm = h2f(b + 2) * (float)mn;
      u32 qs[8], qh[8];
      load32<16>(b + (QT == 12 ? 16 : 48) + (j >> 1) * 32, qs);  // 144 / 176-byte blocks
      if constexpr (QT == 13) load32<16>(b + 16, qh);
#pragma unroll
      for (int l = 0; l < 32; ++l) {
        const u32 v = byte_of(qs, l);
        int q = (j & 1) ? (v >> 4) : (v & 15);
        if constexpr (QT == 13) q |= ((byte_of(qh, l) >> j) & 1) << 4;
        w[l] = ds * (float)q - dm;
      }
    }
  }
}

// grid.x * 8 warps cover the N rows; x [M][K] (row stride ldx), out [M][N] (row stride ldo).
template <int QT, int M, int DT>
__global__ void __launch_bounds__(256) gguf_gemv_kernel(const u16* __restrict__ x,
                                                        const u8* __restrict__ w,
                                                        u16* __restrict__ out, int N, int K,
                                                        i64 row_bytes, i64 ldx, i64 ldo) {
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (r >= N) return;
  const u8* row = w + (size_t)r * row_bytes;
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  const int chunks = K >> 5;
  for (int c = lane; c < chunks; c += 32) {
    float wv[32];
    decode_chunk<QT>(row, c, wv);
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
      acc[m] += s;
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
template <int QT, int DT>
__global__ void __launch_bounds__(256) gguf_dequant_kernel(const u8* __restrict__ w,
                                                           u16* __restrict__ out, int N, int K,
                                                           i64 row_bytes) {
  const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const int chunks = K >> 5;
  if (t >= (i64)N * chunks) return;
  const int r = (int)(t / chunks), c = (int)(t % chunks);
  float wv[32];
  decode_chunk<QT>(w + (size_t)r * row_bytes, c, wv);
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
