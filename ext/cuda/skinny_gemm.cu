// Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T with M <= 8 (a few tokens), bf16/fp16
// in and out, fp32 accumulation. At such M the product is bound by reading W once; cuBLAS'
// GEMV-like paths leave part of HBM bandwidth unused on Hopper, so this kernel is a plain
// streaming reduction tuned for bytes in flight.
//
// One warp owns R consecutive rows of W. Each lane reads 16 bytes (8 elements) of each of its
// rows per step, U steps issued before any is consumed (U * R 16-byte loads in flight per lane),
// multiplies them with the matching 8 elements of every x row (x stays in L1/L2: it is M * K * 2
// bytes) and keeps M * R fp32 partial sums; a butterfly shuffle reduces them at the end.
// Requirements (checked by the launcher): K % 8 == 0, W contiguous, x and y rows 16-byte aligned.
//
// GLU = 1 fuses the gated MLP's activation: W is gate_up [2 * n, K] (gate rows first), a warp
// reads gate row j and up row n + j for each of its R output rows and writes
// y[m, j] = silu(gate) * up, rounded once from fp32.
#include "common.cuh"

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
