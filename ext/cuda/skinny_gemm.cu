// Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T with M <= 8 (a few tokens), bf16/fp16
// in and out, fp32 accumulation. At such M the product is bound by reading W once; cuBLAS'
// GEMV-like paths leave part of HBM bandwidth unused on Hopper, so this kernel is a plain
// streaming reduction tuned for bytes in flight.
//
// One warp owns R weight rows. Each lane reads 16 bytes (8 elements) of each of its rows per
// step, U steps issued before any is consumed (U * R 16-byte loads in flight per lane),
// multiplies them with the matching 8 elements of every x row (x stays in L1/L2: it is M * K * 2
// bytes) and keeps M * R fp32 partial sums; a butterfly shuffle reduces them at the end.
// Requirements (checked by the launcher): K % 8 == 0, W contiguous, x and y rows 16-byte aligned.
//
// Four kernels share that reduction:
// - skinny_gemm_kernel<..., GLU = 0>: y = x W^T.
// - skinny_gemm_kernel<..., GLU = 1>: W is a gated MLP's gate_up [2N, K] (gate rows first); a
//   warp reads gate row j and up row N + j and writes y[m, j] = silu(gate) * up, rounded once.
// - skinny_qkv_rope_kernel: W is an attention layer's fused qkv [(H + 2 KVH) * D, K]; a warp
//   reads rows i and i + D/2 of one head, adds the bias, rotates q and k heads (neox rotary,
//   cos/sin given per token) and writes q to q_out and k, v straight into their paged KV slots
//   (slot < 0: a padding row, skipped), replacing the rotary and KV-write kernels.
// - moe_gemv_kernel: a MoE layer's routed experts, every (token, expert) slot of a step (below);
//   moe_down_kernel: the down pass of a decode-sized step, token by token, summed in the kernel.
#include "common.cuh"

// The x rows warp_dot reads: M rows of one matrix at a stride, or M gathered row pointers.
struct StridedRows {
  const u16* x;
  i64 ld;
  __device__ __forceinline__ const u16* operator()(int m) const { return x + m * ld; }
};
template <int M>
struct GatheredRows {
  const u16* r[M];
  __device__ __forceinline__ const u16* operator()(int m) const { return r[m]; }
};

// acc[m][r] = xr(m)[:] . wr[r][:], reduced across the warp (every lane holds the sums).
template <int M, int R, int U, int DT, class XRows>
__device__ __forceinline__ void warp_dot(const XRows& xr, const u16* const (&wr)[R], int k,
                                         int lane, float (&acc)[M][R]) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;

  const int step = 32 * 8;  // elements a warp covers per step
  int k0 = lane * 8;
  // Main loop: U steps' loads in flight before any use.
  for (; k0 + (U - 1) * step < k; k0 += U * step) {
    V16 wv[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) wv[u][r] = ldg16(wr[r] + k0 + u * step);
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float xf[8];
        unpack8<DT>(ldg16(xr(m) + k0 + u * step), xf);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float wf[8];
          unpack8<DT>(wv[u][r], wf);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[m][r] = fmaf(xf[j], wf[j], acc[m][r]);
        }
      }
    }
  }
  // Tail: fewer than U steps left.
  for (; k0 < k; k0 += step) {
    V16 wv[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wv[r] = ldg16(wr[r] + k0);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float xf[8];
      unpack8<DT>(ldg16(xr(m) + k0), xf);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float wf[8];
        unpack8<DT>(wv[r], wf);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[m][r] = fmaf(xf[j], wf[j], acc[m][r]);
      }
    }
  }

#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v = acc[m][r];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      acc[m][r] = v;
    }
}

template <int M, int R0, int U, int DT, int GLU>
__global__ void __launch_bounds__(256) skinny_gemm_kernel(
    const u16* __restrict__ x,  // [M, K], row stride ldx
    const u16* __restrict__ w,  // [N, K] ([2N, K] with GLU), contiguous
    u16* __restrict__ y,        // [M, N], row stride ldy
    int n, int k, i64 ldx, i64 ldy) {
  constexpr int R = GLU ? 2 * R0 : R0;  // weight rows per warp
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * (blockDim.x >> 5) + warp) * R0;  // first output row
  if (row0 >= n) return;

  const u16* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int j = GLU ? r % R0 : r;
    const int row = row0 + j < n ? row0 + j : n - 1;  // clamp: a tail row is read, not written
    wr[r] = w + (i64)(GLU && r >= R0 ? row + n : row) * k;
  }
  float acc[M][R];
  warp_dot<M, R, U, DT>(StridedRows{x, ldx}, wr, k, lane, acc);

  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R0; ++r) {
        if (row0 + r >= n) continue;
        float v = acc[m][r];
        if constexpr (GLU) v = v / (1.f + __expf(-v)) * acc[m][R0 + r];
        y[m * ldy + row0 + r] = from_float<DT>(v);
      }
  }
}

template <int M, int R0, int U, int DT>
__global__ void __launch_bounds__(256) skinny_qkv_rope_kernel(
    const u16* __restrict__ x,     // [M, K], row stride ldx
    const u16* __restrict__ w,     // [(H + 2 * KVH) * D, K], contiguous
    const u16* __restrict__ bias,  // [(H + 2 * KVH) * D] or null
    const u16* __restrict__ cos,   // [M, D], row stride ldc (cos[i] == cos[i + D/2])
    const u16* __restrict__ sin,   // [M, D], row stride ldc
    u16* __restrict__ q_out,       // [M, H, D] contiguous
    u16* __restrict__ k_cache,     // [NB, BS, KVH, D]
    u16* __restrict__ v_cache,     // [NB, BS, KVH, D]
    const long long* __restrict__ slot_mapping,  // [M]
    int num_heads, int num_kv_heads, int head_dim, int k, i64 ldx, i64 ldc) {
  constexpr int R = 2 * R0;  // rows i (r < R0) and i + D/2 (r >= R0) of R0 rotation pairs
  const int half = head_dim >> 1;
  const int npairs = (num_heads + 2 * num_kv_heads) * half;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int p0 = (blockIdx.x * (blockDim.x >> 5) + warp) * R0;  // first pair
  if (p0 >= npairs) return;

  const u16* wr[R];
  int row_lo[R0];
#pragma unroll
  for (int r = 0; r < R0; ++r) {
    const int p = p0 + r < npairs ? p0 + r : npairs - 1;
    const int head = p / half;
    row_lo[r] = head * head_dim + (p - head * half);
    wr[r] = w + (i64)row_lo[r] * k;
    wr[R0 + r] = wr[r] + (i64)half * k;
  }
  float acc[M][R];
  warp_dot<M, R, U, DT>(StridedRows{x, ldx}, wr, k, lane, acc);

  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < R0; ++r) {
    if (p0 + r >= npairs) continue;
    const int head = row_lo[r] / head_dim;
    const int i = row_lo[r] - head * head_dim;
    const float b_lo = bias ? ld_f<DT>(bias + row_lo[r]) : 0.f;
    const float b_hi = bias ? ld_f<DT>(bias + row_lo[r] + half) : 0.f;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      // rounded to the storage dtype first, as the unfused path's qkv output is
      float lo = round_dt<DT>(acc[m][r] + b_lo);
      float hi = round_dt<DT>(acc[m][R0 + r] + b_hi);
      if (head < num_heads + num_kv_heads) {  // q or k: rotate the pair (x_i, x_{i + D/2})
        const float c = ld_f<DT>(cos + m * ldc + i);
        const float s = ld_f<DT>(sin + m * ldc + i);
        const float rlo = lo * c - hi * s;
        hi = hi * c + lo * s;
        lo = rlo;
      }
      if (head < num_heads) {
        u16* q = q_out + ((i64)m * num_heads + head) * head_dim + i;
        q[0] = from_float<DT>(lo);
        q[half] = from_float<DT>(hi);
        continue;
      }
      const long long slot = slot_mapping[m];
      if (slot < 0) continue;  // padding row of a graph batch
      const bool is_k = head < num_heads + num_kv_heads;
      const int kh = head - num_heads - (is_k ? 0 : num_kv_heads);
      u16* dst = (is_k ? k_cache : v_cache) + (slot * num_kv_heads + kh) * head_dim + i;
      dst[0] = from_float<DT>(lo);
      dst[half] = from_float<DT>(hi);
    }
  }
}

// ------------------------------------------------------------------ routed experts (MoE)
// Decode-sized MoE steps with every expert on the GPU (models/layers/gpu_experts.py): the
// S = T * top_k (token, expert) slots of a step, sorted by expert: sorted_ids[p] is the expert of
// sorted position p and order[p] its slot (slot s = token * top_k + j). A run is the positions
// of one expert; a block computes one run's rows of that expert's weight, M_MAX slots at a time,
// so a step reads each touched expert's rows once per M_MAX of its slots, not once per slot.
// Grid: x = row blocks; y = sorted positions (offsets null: the block works only where its
// position starts a run) or experts (offsets [E + 1]: the run is [offsets[e], offsets[e + 1])).
// Ids lie in [0, E), or are negative: a slot computed elsewhere, skipped (its rows unwritten).
// - GLU = 1: w = w13 [E, 2N, K] (gate rows, then up rows); x row of slot s = x[s / top_k];
//   y = act [S, N] (16-bit): silu(gate) * up, rounded once.
// - GLU = 0: w = w2 [E, N, K]; x row of slot s = x[s] (the act rows); y = float [S, N], times
//   the slot's routing weight slot_w[s] (float).
template <int M, int R0, int U, int DT, int GLU>
__device__ __forceinline__ void moe_rows(const u16* __restrict__ x, i64 ldx, const u16* w_e,
                                         const long long* __restrict__ order,
                                         const float* __restrict__ slot_w, void* y, int n, int k,
                                         int top_k, i64 ldy, int p, int count, int row0,
                                         int lane) {
  constexpr int R = GLU ? 2 * R0 : R0;
  const u16* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int j = GLU ? r % R0 : r;
    const int row = row0 + j < n ? row0 + j : n - 1;  // clamp: a tail row is read, not written
    wr[r] = w_e + (i64)(GLU && r >= R0 ? row + n : row) * k;
  }
  long long slot[M];
  GatheredRows<M> xr;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    slot[m] = order[p + (m < count ? m : count - 1)];  // clamp: a tail slot is read, not written
    xr.r[m] = x + (GLU ? slot[m] / top_k : slot[m]) * ldx;
  }
  float acc[M][R];
  warp_dot<M, R, U, DT>(xr, wr, k, lane, acc);
  if (lane != 0) return;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if (m >= count) break;
#pragma unroll
    for (int r = 0; r < R0; ++r) {
      if (row0 + r >= n) continue;
      const float v = acc[m][r];
      if constexpr (GLU) {
        ((u16*)y)[slot[m] * ldy + row0 + r] = from_float<DT>(v / (1.f + __expf(-v)) * acc[m][R0 + r]);
      } else {
        ((float*)y)[slot[m] * ldy + row0 + r] = v * slot_w[slot[m]];
      }
    }
  }
}

template <int R0, int U, int DT, int GLU>
__global__ void __launch_bounds__(256) moe_gemv_kernel(
    const u16* __restrict__ x,                 // GLU: hidden [T, K]; else act [S, K]; row stride ldx
    const u16* __restrict__ w,                 // [E, 2N or N, K], contiguous
    const long long* __restrict__ sorted_ids,  // [S] expert of each sorted position, ascending
    const long long* __restrict__ order,       // [S] slot of each sorted position
    const long long* __restrict__ offsets,     // [E + 1] run bounds, or null (see above)
    const float* __restrict__ slot_w,          // [S] routing weight per slot (GLU = 0)
    void* __restrict__ y,                      // [S, N], row stride ldy
    int n, int k, int num_slots, int top_k, i64 ldx, i64 ldy) {
  constexpr int M_MAX = 8;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * (blockDim.x >> 5) + warp) * R0;
  if (row0 >= n) return;
  long long e;
  int begin, end;
  if (offsets != nullptr) {
    e = blockIdx.y;
    begin = (int)offsets[e];
    end = (int)offsets[e + 1];
  } else {
    begin = blockIdx.y;
    e = sorted_ids[begin];
    if (e < 0) return;  // a slot routed elsewhere (the CPU pool): nothing here
    if (begin > 0 && sorted_ids[begin - 1] == e) return;  // not the start of a run
    end = begin + 1;
    while (end < num_slots && sorted_ids[end] == e) ++end;
  }
  const u16* w_e = w + e * (i64)(GLU ? 2 * n : n) * k;
  for (int p = begin; p < end; p += M_MAX) {
    const int count = end - p < M_MAX ? end - p : M_MAX;
    if (count == 1)
      moe_rows<1, R0, U, DT, GLU>(x, ldx, w_e, order, slot_w, y, n, k, top_k, ldy, p, count, row0, lane);
    else if (count == 2)
      moe_rows<2, R0, U, DT, GLU>(x, ldx, w_e, order, slot_w, y, n, k, top_k, ldy, p, count, row0, lane);
    else if (count <= 4)
      moe_rows<4, R0, U, DT, GLU>(x, ldx, w_e, order, slot_w, y, n, k, top_k, ldy, p, count, row0, lane);
    else
      moe_rows<M_MAX, R0, U, DT, GLU>(x, ldx, w_e, order, slot_w, y, n, k, top_k, ldy, p, count, row0, lane);
  }
}

// The dot product of 8 16-bit elements, in fp32.
template <int DT>
__device__ __forceinline__ float dot8(const V16& a, const V16& b) {
  float af[8], bf[8];
  unpack8<DT>(a, af);
  unpack8<DT>(b, bf);
  float d = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) d = fmaf(af[i], bf[i], d);
  return d;
}

// The down pass of a decode-sized step, token-major (ext/cuda/skinny.py: moe_decode_experts):
// block (bx, t); warp w owns output row h of token t and sums over the token's K slots j:
// weights[t * K + j] * (act[t * K + j] . w2[ids[t * K + j]][h]). The K experts' loads are issued
// together (U steps of each in flight); each lane keeps one weighted partial sum, the warp
// reduces once and writes out[t, h] rounded once: no float buffer and no separate sum.
template <int K, int U, int DT>
__global__ void __launch_bounds__(256) moe_down_kernel(
    const u16* __restrict__ act,           // [T * K, I], row stride lda
    const u16* __restrict__ w2,            // [E, N, I], contiguous
    const long long* __restrict__ ids,     // [T * K] expert of each slot
    const float* __restrict__ weights,     // [T * K] routing weight of each slot
    u16* __restrict__ out,                 // [T, N], row stride ldo
    int n, int k, i64 lda, i64 ldo) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * (blockDim.x >> 5) + warp;
  if (row >= n) return;
  const long long t = blockIdx.y;
  const u16* wr[K];
  const u16* xr[K];
  float wj[K];
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const long long s = t * K + j;
    wr[j] = w2 + (ids[s] * n + row) * (i64)k;
    xr[j] = act + s * lda;
    wj[j] = weights[s];
  }
  float part = 0.f;
  const int step = 32 * 8;
  int k0 = lane * 8;
  for (; k0 + (U - 1) * step < k; k0 += U * step) {
    V16 wv[U][K];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < K; ++j) wv[u][j] = ldg16(wr[j] + k0 + u * step);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < K; ++j)
        part = fmaf(wj[j], dot8<DT>(ldg16(xr[j] + k0 + u * step), wv[u][j]), part);
  }
  for (; k0 < k; k0 += step) {
    V16 wv[K];
#pragma unroll
    for (int j = 0; j < K; ++j) wv[j] = ldg16(wr[j] + k0);
#pragma unroll
    for (int j = 0; j < K; ++j) part = fmaf(wj[j], dot8<DT>(ldg16(xr[j] + k0), wv[j]), part);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
  if (lane == 0) out[t * ldo + row] = from_float<DT>(part);
}
