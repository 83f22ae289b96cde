// GGUF 4-bit weights (Q4_0 = 2, Q4_1 = 3, Q4_K = 12 as QT) in the tile layout of gguf_tile.py:
// y[M, N] = x[M, K] @ W[N, K]^T through m16n8k16 MMAs, A = 16 weight rows (codes turned into
// exact 16-bit integers in registers), B = up to 8 rows of x per MMA, fp32 accumulation; block
// scales applied to each 32-column partial sum, mins through a second MMA against ones.
// gguf_tile_gemv_kernel: one CTA per R tiles (16 rows each), its 8 (or 16) warps split the
// 64-column chunks, then sum through shared memory. gguf_tile_dequant_kernel: the whole matrix into a scratch
// buffer for cuBLAS at prefill sizes.
#include "common.cuh"

typedef unsigned char u8;

template <int QT>
struct TileFmt {
  static constexpr int META = QT == 3 ? 128 : 64;  // scale bytes per 64-column chunk
  static constexpr int SB = QT == 12 ? 64 : 0;     // bytes per 256-column superblock
  static constexpr int OFF = QT == 2 ? 8 : 0;      // code offset (Q4_0: value = d * (q - 8))
};

template <int QT>
__device__ __forceinline__ i64 tile_bytes(int K) {
  return (i64)(K >> 6) * (512 + TileFmt<QT>::META) + (i64)(K >> 8) * TileFmt<QT>::SB;
}

__device__ __forceinline__ float half_bits(u32 h) {
  float lo, hi;
  unpack2<0>(h, lo, hi);
  return lo;
}

// Codes p and p + 4 of word w (bits 4p and 16 + 4p) -> a 16-bit pair (q - OFF) exactly.
template <int DT, int OFF>
__device__ __forceinline__ u32 code_pair(u32 w, int shift) {
  const u32 magic = DT == 1 ? 0x43004300u : 0x64006400u;  // 128 (bf16) / 1024 (fp16), ulp 1
  const u32 v = ((w >> shift) & 0x000F000Fu) | magic;
  const u32 neg = (magic | (OFF * 0x00010001u)) | 0x80008000u;  // -(magic + OFF)
  u32 r;
  if constexpr (DT == 1) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x3F803F80u), "r"(neg));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x3C003C00u), "r"(neg));
  }
  return r;
}

// Codes p and p + 4 of word w -> the 16-bit pair (magic + q) exactly, magic = 128 (bf16) /
// 1024 (fp16): the GEMV with FOLD = 1 subtracts magic (and Q4_0's 8) through x's block sums.
template <int DT>
__device__ __forceinline__ u32 code_raw(u32 w, int shift) {
  return ((w >> shift) & 0x000F000Fu) | (DT == 1 ? 0x43004300u : 0x64006400u);
}

// Byte i of w as a float: its bits under 2^23's exponent, minus 2^23 (no conversion unit).
__device__ __forceinline__ float byte_f(u32 w, int i) {
  return __uint_as_float(0x4B000000u | ((w >> (8 * i)) & 255u)) - 8388608.f;
}

struct U2 {
  u32 x, y;
};
__device__ __forceinline__ U2 ldg8(const void* p) {
  U2 r;
  asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

// The raw scale words of one chunk for this lane's rows g and g + 8 (see gguf_tile.py).
struct ScaleWords {
  V16 s;  // Q4_0: s.x, s.y; Q4_1: all four; Q4_K: s.x, s.y sub-block scales, s.z, s.w d/dmin
};

template <int QT>
__device__ __forceinline__ ScaleWords load_scales(const u8* meta, const u8* sb, int c, int g) {
  ScaleWords r;
  if constexpr (QT == 3) {
    r.s = ldg16(meta + (i64)c * 128 + g * 16);
  } else {
    const U2 a = ldg8(meta + (i64)c * 64 + g * 8);
    r.s.x = a.x, r.s.y = a.y, r.s.z = r.s.w = 0u;
    if constexpr (QT == 12) {
      const U2 dd = ldg8(sb + (i64)(c >> 2) * 64 + g * 8);
      r.s.z = dd.x, r.s.w = dd.y;
    }
  }
  return r;
}

// value = d[2h + b] * q + m[2h + b] for row g + 8h, block b (Q4_0: q already minus 8, m = 0).
template <int QT>
__device__ __forceinline__ void scales_of(const ScaleWords& r, float* d, float* m) {
  if constexpr (QT == 2) {
    d[0] = half_bits(r.s.x & 0xffffu), d[1] = half_bits(r.s.x >> 16);
    d[2] = half_bits(r.s.y & 0xffffu), d[3] = half_bits(r.s.y >> 16);
    m[0] = m[1] = m[2] = m[3] = 0.f;
  } else if constexpr (QT == 3) {
    const u32 w[4] = {r.s.x, r.s.y, r.s.z, r.s.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) d[i] = half_bits(w[i] & 0xffffu), m[i] = half_bits(w[i] >> 16);
  } else {
    const u32 sw[2] = {r.s.x, r.s.y}, dw[2] = {r.s.z, r.s.w};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float dh = half_bits(dw[h] & 0xffffu), dmin = half_bits(dw[h] >> 16);
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        d[2 * h + b] = dh * byte_f(sw[h], b);
        m[2 * h + b] = -dmin * byte_f(sw[h], b + 2);
      }
    }
  }
}

// Everything one warp reads for one chunk of R tiles: their codes and scales, and x's 2 x 8
// values per MMA column group (shared by the R tiles).
template <int QT, int MT, int R>
struct ChunkLoads {
  V16 q[R];
  ScaleWords sc[R];
  V16 xb[2][MT];
};

template <int QT, int MT, int R>
__device__ __forceinline__ void load_weights(ChunkLoads<QT, MT, R>& L, const u8* w, i64 tbytes,
                                             int chunks, int c, int lane, int g) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const u8* codes = w + r * tbytes;
    const u8* meta = codes + (i64)chunks * 512;
    L.q[r] = ldg16(codes + (i64)c * 512 + lane * 16);
    L.sc[r] = load_scales<QT>(meta, meta + (i64)chunks * TileFmt<QT>::META, c, g);
  }
}

template <int QT, int M, int MT, int R>
__device__ __forceinline__ void load_x(ChunkLoads<QT, MT, R>& L, const u16* x, i64 ldx, int c,
                                       int g, int t) {
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      const int row = 8 * j + g;
      if (row < M) {
        L.xb[b][j] = ldg16(x + (i64)row * ldx + c * 64 + b * 32 + t * 8);
      } else {
        L.xb[b][j].x = L.xb[b][j].y = L.xb[b][j].z = L.xb[b][j].w = 0u;
      }
    }
}

template <int QT, int M, int MT, int R>
__device__ __forceinline__ void load_chunk(ChunkLoads<QT, MT, R>& L, const u8* w, i64 tbytes,
                                           int chunks, const u16* x, i64 ldx, int c, int lane,
                                           int g, int t) {
  load_weights<QT, MT, R>(L, w, tbytes, chunks, c, lane, g);
  load_x<QT, M, MT, R>(L, x, ldx, c, g, t);
}

// FOLD = 0: codes become exact (q - OFF) pairs (one fma each); FOLD = 1: raw (magic + q) pairs,
// and d * (magic + OFF) joins the block's min term, sum(x) * (m - d * (magic + OFF)).
template <int QT, int DT, int MT, int R, int FOLD>
__device__ __forceinline__ void mma_chunk(const ChunkLoads<QT, MT, R>& L, float (*acc)[MT][4]) {
  constexpr bool MIN = QT != 2 || FOLD;
  constexpr int OFF = TileFmt<QT>::OFF;
  constexpr float BIAS = FOLD ? (DT == 1 ? 128.f : 1024.f) + OFF : 0.f;
  const u32 ones = DT == 1 ? 0x3F803F80u : 0x3C003C00u;
  const u32 ones4[4] = {ones, ones, ones, ones};
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    float sum[MT][4];  // x's sums over the block's 32 columns (for the mins)
    if constexpr (MIN) {
#pragma unroll
      for (int j = 0; j < MT; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) sum[j][i] = 0.f;
        mma16816<DT>(sum[j], ones4, L.xb[b][j].x, L.xb[b][j].y);
        mma16816<DT>(sum[j], ones4, L.xb[b][j].z, L.xb[b][j].w);
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float d[4], m[4];
      scales_of<QT>(L.sc[r], d, m);
      if constexpr (FOLD) {
#pragma unroll
        for (int k = 0; k < 4; ++k) m[k] = fmaf(-BIAS, d[k], m[k]);
      }
      const u32 qw[4] = {L.q[r].x, L.q[r].y, L.q[r].z, L.q[r].w};
      float part[MT][4];
#pragma unroll
      for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) part[j][i] = 0.f;
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const u32 word = qw[2 * b + s];
        u32 a[4];
#pragma unroll
        for (int p = 0; p < 4; ++p)
          a[p] = FOLD ? code_raw<DT>(word, 4 * p) : code_pair<DT, OFF>(word, 4 * p);
#pragma unroll
        for (int j = 0; j < MT; ++j) {
          const u32 b0 = s ? L.xb[b][j].z : L.xb[b][j].x, b1 = s ? L.xb[b][j].w : L.xb[b][j].y;
          mma16816<DT>(part[j], a, b0, b1);
        }
      }
#pragma unroll
      for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int k = 2 * (i >> 1) + b;
          acc[r][j][i] = fmaf(d[k], part[j][i], acc[r][j][i]);
          if constexpr (MIN) acc[r][j][i] = fmaf(m[k], sum[j][i], acc[r][j][i]);
        }
    }
  }
}

// One CTA per R consecutive 16-row tiles; grid.x = N / (16 R). x [M][K] (row stride ldx), out
// [M][N] (ldo). Warp w takes chunks w, w + W, ...; the loads of D chunks stay in flight.
// SW = 1: each tile holds 8 gate rows then the 8 up rows of the same intermediate indices, so a
// lane's rows g and g + 8 meet in its registers; out [M][N / 2] = silu(gate) * up, each step
// rounded to the 16-bit type as the torch expression does.
// W warps per CTA (8, or 16 for matrices with too few tiles to fill the SMs otherwise), D
// chunks in flight per warp, FOLD as in mma_chunk. Launched with programmatic dependent launch, the first chunks'
// weights load while the previous kernel finishes; x is read (and out written) after pdl_wait.
template <int QT, int M, int DT, int R, int SW = 0, int W = 8, int D = 2, int FOLD = 0>
__global__ void __launch_bounds__(W * 32, 2) gguf_tile_gemv_kernel(const u16* __restrict__ x,
                                                               const u8* __restrict__ w,
                                                               u16* __restrict__ out, int K,
                                                               i64 ldx, i64 ldo) {
  constexpr int MT = (M + 7) / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int chunks = K >> 6;
  const i64 tbytes = tile_bytes<QT>(K);
  const u8* tiles = w + (i64)blockIdx.x * R * tbytes;
  float acc[R][MT][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < MT; ++j) acc[r][j][0] = acc[r][j][1] = acc[r][j][2] = acc[r][j][3] = 0.f;

  ChunkLoads<QT, MT, R> L[D];
#pragma unroll
  for (int i = 0; i < D; ++i)
    if (warp + W * i < chunks)
      load_weights<QT, MT, R>(L[i], tiles, tbytes, chunks, warp + W * i, lane, g);
  pdl_wait();
  pdl_trigger();
#pragma unroll
  for (int i = 0; i < D; ++i)
    if (warp + W * i < chunks) load_x<QT, M, MT, R>(L[i], x, ldx, warp + W * i, g, t);
  for (int c0 = warp; c0 < chunks; c0 += W * D) {
#pragma unroll
    for (int i = 0; i < D; ++i) {
      const int c = c0 + W * i;
      if (c < chunks) {
        mma_chunk<QT, DT, MT, R, FOLD>(L[i], acc);
        if (c + W * D < chunks)
          load_chunk<QT, M, MT, R>(L[i], tiles, tbytes, chunks, x, ldx, c + W * D, lane, g, t);
      }
    }
  }

  __shared__ float red[W][R * MT * 4][32];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][(r * MT + j) * 4 + i][lane] = acc[r][j][i];
  __syncthreads();
  // warp r (< R) sums the values of tile r
  if (warp >= R) return;
  const int r = warp;
#pragma unroll
  for (int j = 0; j < MT; ++j) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = 0.f;
#pragma unroll
      for (int w2 = 0; w2 < W; ++w2) v[i] += red[w2][(r * MT + j) * 4 + i][lane];
    }
#pragma unroll
    for (int i = 0; i < (SW ? 2 : 4); ++i) {
      const int row = 8 * j + 2 * t + (i & 1);  // row of x (and of out)
      if (row >= M) continue;
      if constexpr (SW) {
        const float gr = round_dt<DT>(v[i]), ur = round_dt<DT>(v[i + 2]);
        const float act = round_dt<DT>(gr / (1.f + __expf(-gr)));
        out[(i64)row * ldo + (blockIdx.x * R + r) * 8 + g] = from_float<DT>(act * ur);
      } else {
        const int col = (blockIdx.x * R + r) * 16 + g + 8 * (i >> 1);
        out[(i64)row * ldo + col] = from_float<DT>(v[i]);
      }
    }
  }
}

// One thread per (tile, chunk, lane): its 32 codes (rows g and g + 8, 16 columns each) decoded
// as the reference does (d * (q - 8), d * q + m, d * sc * q - dmin * mn in fp32), 16-bit out.
template <int QT, int DT>
__global__ void __launch_bounds__(256) gguf_tile_dequant_kernel(const u8* __restrict__ w,
                                                                u16* __restrict__ out, int N,
                                                                int K) {
  const i64 id = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const int chunks = K >> 6;
  if (id >= (i64)(N >> 4) * chunks * 32) return;
  const int lane = (int)(id & 31), g = lane >> 2, t = lane & 3;
  const i64 tc = id >> 5;
  const int tile = (int)(tc / chunks), c = (int)(tc % chunks);
  const u8* codes = w + (i64)tile * tile_bytes<QT>(K);
  const u8* meta = codes + (i64)chunks * 512;
  const u8* sb = meta + (i64)chunks * TileFmt<QT>::META;
  const V16 q = ldg16(codes + (i64)c * 512 + lane * 16);
  float d[4], m[4];
  scales_of<QT>(load_scales<QT>(meta, sb, c, g), d, m);
  const u32 qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    u16* orow = out + (i64)(tile * 16 + g + 8 * h) * K + c * 64 + t * 8;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const float db = d[2 * h + b], mb = m[2 * h + b];
      float v[8];  // columns 32b + 8t + {0..7}: both k-tiles' halves, one 16-byte store
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const u32 word = qw[2 * b + s];
#pragma unroll
        for (int e = 0; e < 2; ++e)  // pair p = h + 2e: columns 4s + 2e + {0, 1}
#pragma unroll
          for (int lo = 0; lo < 2; ++lo) {
            const int qv = (int)((word >> (4 * (h + 2 * e) + 16 * lo)) & 15u) - TileFmt<QT>::OFF;
            v[4 * s + 2 * e + lo] = db * (float)qv + mb;
          }
      }
      V16 o;
      o.x = pack2<DT>(v[0], v[1]);
      o.y = pack2<DT>(v[2], v[3]);
      o.z = pack2<DT>(v[4], v[5]);
      o.w = pack2<DT>(v[6], v[7]);
      stg16(orow + b * 32, o);
    }
  }
}
