// A MoE layer's routed experts kept packed on the GPU (ext/cuda/moe_quant.py), dequantized in
// registers, fp32 accumulation. Layouts (models/quant/experts.py): Q4_0 (QT 2), Q8_0 (8) and
// MXFP4 (39) as planes: per row the blocks' codes (16 bytes of nibbles, value i < 16 the low
// nibble of byte i and i + 16 its high one; or 32 int8) then, in a second tensor, the blocks'
// scales (fp16 d; or the e8m0 byte); one 16-byte load per lane and 32 values. GPTQ / AWQ int4
// (QT 1000 + group size) the same, its plane per group an fp16 scale and a zero point byte; FP8
// e4m3 (QT 2000 + columns per scale) its bytes, a float32 scale per B columns of each row.
// Other GGUF types (Q4_1, Q4_K, Q5_K, Q6_K) as GGUF rows (decode_chunk of gguf_linear.cu).
// - qmoe_gemv_kernel: the S (token, expert) slots of a step sorted by expert, as
//   skinny_gemm.cu's moe_gemv_kernel: a block computes one expert run's rows, up to 8 slots per
//   pass, so a step reads each touched expert's packed rows once per 8 of its slots. GLU = 1:
//   w13 [E][2N rows] (gate, then up) -> act [S, N] 16-bit; GLU = 0: w2 [E][N rows] -> float
//   [S, N] times the slot's routing weight. Optional 16-bit biases b [E, 2N] / [E, N] (GPT-OSS),
//   ACT 0: silu(gate) * up; 1: GPT-OSS's clamped SwiGLU (alpha, limit).
// - qmoe_dequant_kernel: every expert with slots (offsets) into a 16-bit [E, rows, K] scratch
//   for grouped GEMMs at prefill sizes; experts without slots are skipped (left unwritten).
#include "gguf_linear.cu"
#define HF_LINEAR_DECODE_ONLY
#include "hf_linear.cu"

// An e2m1 nibble's value doubled (0, 1, 2, 3, 4, 6, 8, 12, then the same negated), from a byte
// table in a 64-bit constant (no local-memory array).
__device__ __forceinline__ float e2m1x2(u32 v) {  // v < 16
  const float mag = (float)((0x0C08060403020100ull >> (8 * (v & 7))) & 255u);
  return (v & 8) ? -mag : mag;
}

// Chunk c (32 values) of a row: q the row's codes (planes) or its GGUF blocks, sc the row's
// scales (planes only) -> the 32 values before the scale in w; returns the scale.
template <int QT>
__device__ __forceinline__ float qmoe_chunk(const u8* q, const u8* sc, int c, float* w) {
  if constexpr (QT == 2 || QT == 39) {
    const V16 v = ldg16(q + c * 16);
    const u32 b[4] = {v.x, v.y, v.z, v.w};
    if constexpr (QT == 2) {
      decode_int4_chunk(b, 1.f, 8.f, w);
      return h2f(sc + 2 * c);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const u32 x = b[i >> 2] >> (8 * (i & 3));
        w[i] = e2m1x2(x & 15u);
        w[i + 16] = e2m1x2((x >> 4) & 15u);
      }
      return __uint_as_float((u32)sc[c] << 23) * 0.5f;  // 2^(e - 128); e = 0 flushes to 0
    }
  } else if constexpr (QT == 8) {
    const V16 a = ldg16(q + c * 32), b = ldg16(q + c * 32 + 16);
    const u32 u[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 32; ++i) w[i] = (float)(signed char)((u[i >> 2] >> (8 * (i & 3))) & 255u);
    return h2f(sc + 2 * c);
  } else if constexpr (QT >= 2000) {  // e4m3, a float32 scale per B = QT - 2000 columns
    const V16 a = ldg16(q + c * 32), b = ldg16(q + c * 32 + 16);
    const u32 u[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    decode_fp8_chunk(u, 1.f, w);
    return ((const float*)sc)[(c * 32) / (QT - 2000)];
  } else if constexpr (QT >= 1000) {  // int4, groups of G = QT - 1000: (fp16 scale, zero) each
    const V16 v = ldg16(q + c * 16);
    const u32 b[4] = {v.x, v.y, v.z, v.w};
    const u8* g = sc + 3 * ((c * 32) / (QT - 1000));
    decode_int4_chunk(b, 1.f, (float)g[2], w);
    const u16 bits = (u16)g[0] | ((u16)g[1] << 8);
    return ld_f<0>(&bits);
  } else {
    decode_chunk<QT>(q, c, w);
    return 1.f;
  }
}

// R rows' dot products with the M rows xr, chunks lane, lane + 32, ...: acc[r][m] += row r's
// values . xr[m] (scaled per chunk). The R rows' loads of a chunk are issued together.
template <int QT, int R, int M, int DT>
__device__ __forceinline__ void qmoe_dot(const u8* const* q, const u8* const* sc,
                                         const u16* const* xr, int k, int lane, float (*acc)[M]) {
  const int chunks = k >> 5;
  for (int c = lane; c < chunks; c += 32) {
    float wv[R][32], scale[R];
#pragma unroll
    for (int r = 0; r < R; ++r) scale[r] = qmoe_chunk<QT>(q[r], sc[r], c, wv[r]);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const u16* xp = xr[m] + c * 32;
      float s[R];
#pragma unroll
      for (int r = 0; r < R; ++r) s[r] = 0.f;
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        float xf[8];
        unpack8<DT>(ldg16(xp + v * 8), xf);
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int r = 0; r < R; ++r) s[r] = fmaf(wv[r][v * 8 + i], xf[i], s[r]);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r][m] = fmaf(scale[r], s[r], acc[r][m]);
    }
  }
}

template <int ACT>
__device__ __forceinline__ float qmoe_act(float g, float u, float alpha, float limit) {
  if constexpr (ACT == 0) {
    return g / (1.f + __expf(-g)) * u;
  } else {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return (u + 1.f) * (g / (1.f + __expf(-g * alpha)));
  }
}

template <int QT, int M, int DT, int GLU, int ACT>
__device__ __forceinline__ void qmoe_rows(const u16* __restrict__ x, i64 ldx, const u8* w_e,
                                          i64 rb, const u8* s_e, i64 srb,
                                          const long long* __restrict__ order,
                                          const float* __restrict__ slot_w, const u16* b_e,
                                          void* y, int n, int k, int top_k, i64 ldy, int p,
                                          int count, int row, int lane, float alpha,
                                          float limit) {
  constexpr int R = GLU ? 2 : 1;
  long long slot[M];
  const u16* xr[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    slot[m] = order[p + (m < count ? m : count - 1)];  // clamp: a tail slot is read, not written
    xr[m] = x + (GLU ? slot[m] / top_k : slot[m]) * ldx;
  }
  float acc[R][M];
  const u8* q[R];
  const u8* sc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    const i64 rr = row + r * n;
    q[r] = w_e + rr * rb;
    sc[r] = s_e + rr * srb;
  }
  qmoe_dot<QT, R, M, DT>(q, sc, xr, k, lane, acc);
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], o);
  if (lane != 0) return;
  float b0 = 0.f, b1 = 0.f;
  if (b_e != nullptr) {
    b0 = ld_f<DT>(b_e + row);
    if constexpr (GLU) b1 = ld_f<DT>(b_e + row + n);
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if (m >= count) break;
    if constexpr (GLU) {
      const float a = qmoe_act<ACT>(acc[0][m] + b0, acc[R - 1][m] + b1, alpha, limit);
      ((u16*)y)[slot[m] * ldy + row] = from_float<DT>(a);
    } else {
      ((float*)y)[slot[m] * ldy + row] = (acc[0][m] + b0) * slot_w[slot[m]];
    }
  }
}

// Grid: x = row blocks of 8 rows (a warp a row); y = sorted positions (offsets null: a block
// works only where its position starts a run) or experts (offsets [E + 1]). Ids outside
// [0, E) are slots computed elsewhere: skipped, their rows unwritten. M_MAX (1, 2, 4, 8): the
// most slots per pass, no more than a step can give one expert (fewer registers at batch 1).
template <int QT, int DT, int GLU, int ACT, int M_MAX>
__global__ void __launch_bounds__(256) qmoe_gemv_kernel(
    const u16* __restrict__ x,                 // GLU: hidden [T, K]; else act [S, K]; stride ldx
    const u8* __restrict__ w,                  // [E][rows][rb] codes (planes) or GGUF rows
    const u8* __restrict__ scales,             // [E][rows][srb] (planes) or null
    const long long* __restrict__ sorted_ids,  // [S] expert of each sorted position, ascending
    const long long* __restrict__ order,       // [S] slot of each sorted position
    const long long* __restrict__ offsets,     // [E + 1] run bounds, or null
    const float* __restrict__ slot_w,          // [S] routing weight per slot (GLU = 0)
    const u16* __restrict__ bias,              // [E][GLU ? 2N : N] or null
    void* __restrict__ y,                      // [S, N], row stride ldy
    int n, int k, i64 rb, i64 srb, int num_slots, int num_experts, int top_k, i64 ldx, i64 ldy,
    float alpha, float limit) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= n) return;
  long long e;
  int begin, end;
  if (offsets != nullptr) {
    e = blockIdx.y;
    begin = (int)offsets[e];
    end = (int)offsets[e + 1];
  } else {
    begin = blockIdx.y;
    e = sorted_ids[begin];
    if (e < 0 || e >= num_experts) return;
    if (begin > 0 && sorted_ids[begin - 1] == e) return;  // not the start of a run
    end = begin + 1;
    while (end < num_slots && sorted_ids[end] == e) ++end;
  }
  const int rows = GLU ? 2 * n : n;
  const u8* w_e = w + e * (i64)rows * rb;
  const u8* s_e = scales + e * (i64)rows * srb;  // unused (null + 0) for GGUF rows
  const u16* b_e = bias == nullptr ? nullptr : bias + e * (i64)rows;
  for (int p = begin; p < end; p += M_MAX) {
    const int count = end - p < M_MAX ? end - p : M_MAX;
    if (M_MAX == 1 || count == 1)
      qmoe_rows<QT, 1, DT, GLU, ACT>(x, ldx, w_e, rb, s_e, srb, order, slot_w, b_e, y, n, k, top_k, ldy, p,
                                     count, row, lane, alpha, limit);
    else if (M_MAX == 2 || count == 2)
      qmoe_rows<QT, (M_MAX < 2 ? M_MAX : 2), DT, GLU, ACT>(x, ldx, w_e, rb, s_e, srb, order, slot_w, b_e, y,
                                                           n, k, top_k, ldy, p, count, row, lane,
                                                           alpha, limit);
    else if (M_MAX == 4 || count <= 4)
      qmoe_rows<QT, (M_MAX < 4 ? M_MAX : 4), DT, GLU, ACT>(x, ldx, w_e, rb, s_e, srb, order, slot_w, b_e, y,
                                                           n, k, top_k, ldy, p, count, row, lane,
                                                           alpha, limit);
    else
      qmoe_rows<QT, M_MAX, DT, GLU, ACT>(x, ldx, w_e, rb, s_e, srb, order, slot_w, b_e, y, n, k, top_k, ldy,
                                         p, count, row, lane, alpha, limit);
  }
}

// Grid (ceil(rows * K / 32 / 256), E): one thread per (row, 32-value chunk) of expert
// blockIdx.y, skipped where offsets (not null) say the expert has no slot.
template <int QT, int DT>
__global__ void __launch_bounds__(256) qmoe_dequant_kernel(const u8* __restrict__ w,
                                                           const u8* __restrict__ scales,
                                                           const long long* __restrict__ offsets,
                                                           u16* __restrict__ out, int rows, int K,
                                                           i64 rb, i64 srb) {
  const long long e = blockIdx.y;
  if (offsets != nullptr && offsets[e + 1] == offsets[e]) return;
  const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const int chunks = K >> 5;
  if (t >= (i64)rows * chunks) return;
  const int r = (int)(t / chunks), c = (int)(t % chunks);
  float wv[32];
  const float scale = qmoe_chunk<QT>(w + (e * rows + r) * rb, scales + (e * rows + r) * srb, c, wv);
#pragma unroll
  for (int i = 0; i < 32; ++i) wv[i] *= scale;
  u16* o = out + (e * rows + r) * (i64)K + c * 32;
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

// The down pass of a decode-sized step, token-major: block (bx, t), warp w owns output row h of
// token t and sums its K slots j: weights[t, j] * (w2[ids[t, j]][h] . act[t * K + j] + b2[e][h])
// (ids outside [0, E): nothing), reduced once and written rounded once to out[t, h]; no float
// buffer and no separate sum. A lane takes (slot, chunk) pairs lane, lane + 32, ... of the
// K * chunks, so every slot's loads are in flight together (the slots sit in shared memory).
template <int QT, int K, int DT>
__global__ void __launch_bounds__(256) qmoe_down_kernel(
    const u16* __restrict__ act,         // [T * K, I], row stride lda
    const u8* __restrict__ w,            // [E][N][rb]
    const u8* __restrict__ scales,       // [E][N][srb] or null
    const long long* __restrict__ ids,   // [T * K]
    const float* __restrict__ weights,   // [T * K]
    const u16* __restrict__ bias,        // [E][N] or null
    u16* __restrict__ out,               // [T, N], row stride ldo
    int n, int k, i64 rb, i64 srb, int num_experts, i64 lda, i64 ldo) {
  __shared__ long long s_e[K];
  __shared__ float s_w[K];
  const long long t = blockIdx.y;
  if (threadIdx.x < K) {
    const long long e = ids[t * K + threadIdx.x];
    const bool here = e >= 0 && e < num_experts;
    s_e[threadIdx.x] = here ? e : 0;
    s_w[threadIdx.x] = here ? weights[t * K + threadIdx.x] : 0.f;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= n) return;
  const int chunks = k >> 5;
  float total = 0.f;
#pragma unroll 2
  for (int idx = lane; idx < K * chunks; idx += 32) {
    const int j = idx / chunks, c = idx - j * chunks;
    const float wj = s_w[j];
    if (wj == 0.f) continue;  // a slot routed elsewhere (or weighted 0): not read
    const i64 rr = s_e[j] * n + row;
    const u16* xr[1] = {act + (t * K + j) * lda};
    const u8* q[1] = {w + rr * rb};
    const u8* sc[1] = {scales + rr * srb};
    float wv[32];
    const float scale = qmoe_chunk<QT>(q[0], sc[0], c, wv);
    const u16* xp = xr[0] + c * 32;
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      float xf[8];
      unpack8<DT>(ldg16(xp + v * 8), xf);
#pragma unroll
      for (int i = 0; i < 8; ++i) s = fmaf(wv[v * 8 + i], xf[i], s);
    }
    total = fmaf(wj * scale, s, total);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  if (lane != 0) return;
  if (bias != nullptr) {
#pragma unroll
    for (int j = 0; j < K; ++j) total = fmaf(s_w[j], ld_f<DT>(bias + s_e[j] * n + row), total);
  }
  out[t * ldo + row] = from_float<DT>(total);
}
