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
// Three epilogues share that reduction:
// - skinny_gemm_kernel<..., GLU = 0>: y = x W^T.
// - skinny_gemm_kernel<..., GLU = 1>: W is a gated MLP's gate_up [2N, K] (gate rows first); a
//   warp reads gate row j and up row N + j and writes y[m, j] = silu(gate) * up, rounded once.
// - skinny_qkv_rope_kernel: W is an attention layer's fused qkv [(H + 2 KVH) * D, K]; a warp
//   reads rows i and i + D/2 of one head, adds the bias, rotates q and k heads (neox rotary,
//   cos/sin given per token) and writes q to q_out and k, v straight into their paged KV slots
//   (slot < 0: a padding row, skipped), replacing the rotary and KV-write kernels.
#include "common.cuh"

// acc[m][r] = x[m, :] . wr[r][:], reduced across the warp (every lane holds the sums).
template <int M, int R, int U, int DT>
__device__ __forceinline__ void warp_dot(const u16* __restrict__ x, i64 ldx,
                                         const u16* const (&wr)[R], int k, int lane,
                                         float (&acc)[M][R]) {
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
        unpack8<DT>(ldg16(x + m * ldx + k0 + u * step), xf);
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
      unpack8<DT>(ldg16(x + m * ldx + k0), xf);
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
  warp_dot<M, R, U, DT>(x, ldx, wr, k, lane, acc);

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
  warp_dot<M, R, U, DT>(x, ldx, wr, k, lane, acc);

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
