// RMSNorm in one kernel: y = w * round(x * rsqrt(mean(x^2) + eps)), bf16/fp16 in and out, the
// mean of squares in fp32, the normalized value rounded to the input dtype before the weight
// multiplies it (as HF transformers' LlamaRMSNorm does: `weight * hidden.to(input_dtype)`).
// The torch expression takes ~7 kernels (convert, pow, mean, add, rsqrt, mul, convert, mul); at
// decode batch sizes each is a few microseconds of launch-bound work, four norms a layer.
//
// TPR threads per row (32: one warp per row, 256 / 32 rows a block; 256: one row a block),
// 8 elements per thread per step through 16-byte loads. Requirements (checked by the launcher):
// cols % 8 == 0, rows 16-byte aligned (x, w, y), inner dimension contiguous.
// add_rms_norm_kernel: s = x + d rounded to the 16-bit type (torch's `x + d`), y = RMSNorm(s):
// a residual add and the next norm in one kernel.
#include "common.cuh"

template <int TPR, int DT>
__global__ void __launch_bounds__(256) rms_norm_kernel(const u16* __restrict__ x,
                                                       const u16* __restrict__ w,
                                                       u16* __restrict__ y, int rows, int cols,
                                                       i64 ldx, i64 ldy, float eps) {
  constexpr int ROWS = 256 / TPR;
  const int tid = threadIdx.x % TPR;
  const int row = blockIdx.x * ROWS + threadIdx.x / TPR;
  const bool live = row < rows;
  const u16* xr = x + (i64)row * ldx;
  const int steps = cols / 8;
  pdl_wait();  // launched with programmatic dependent launch: x is the previous kernel's
  pdl_trigger();  // a GEMV launched after this norm may start streaming its weights
  float ss = 0.f;
  if (live) {
    for (int c = tid; c < steps; c += TPR) {
      float f[8];
      unpack8<DT>(ldg16(xr + c * 8), f);
#pragma unroll
      for (int j = 0; j < 8; ++j) ss += f[j] * f[j];
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if constexpr (TPR == 256) {
    __shared__ float part[8];
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    ss = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += part[i];
  }
  if (!live) return;
  const float r = rsqrtf(ss / (float)cols + eps);
  u16* yr = y + (i64)row * ldy;
  for (int c = tid; c < steps; c += TPR) {
    float f[8], g[8];
    unpack8<DT>(ldg16(xr + c * 8), f);
    unpack8<DT>(ldg16(w + c * 8), g);
    V16 out;
    out.x = pack2<DT>(g[0] * round_dt<DT>(f[0] * r), g[1] * round_dt<DT>(f[1] * r));
    out.y = pack2<DT>(g[2] * round_dt<DT>(f[2] * r), g[3] * round_dt<DT>(f[3] * r));
    out.z = pack2<DT>(g[4] * round_dt<DT>(f[4] * r), g[5] * round_dt<DT>(f[5] * r));
    out.w = pack2<DT>(g[6] * round_dt<DT>(f[6] * r), g[7] * round_dt<DT>(f[7] * r));
    stg16(yr + c * 8, out);
  }
}

template <int TPR, int DT>
__global__ void __launch_bounds__(256) add_rms_norm_kernel(
    const u16* __restrict__ x, const u16* __restrict__ d, const u16* __restrict__ w,
    u16* __restrict__ s, u16* __restrict__ y, int rows, int cols, i64 ldx, i64 ldd, i64 lds,
    i64 ldy, float eps) {
  constexpr int ROWS = 256 / TPR;
  const int tid = threadIdx.x % TPR;
  const int row = blockIdx.x * ROWS + threadIdx.x / TPR;
  const bool live = row < rows;
  const u16* xr = x + (i64)row * ldx;
  const u16* dr = d + (i64)row * ldd;
  const int steps = cols / 8;
  pdl_wait();
  pdl_trigger();
  float ss = 0.f;
  if (live) {
    u16* sr = s + (i64)row * lds;
    for (int c = tid; c < steps; c += TPR) {
      float f[8], g[8];
      unpack8<DT>(ldg16(xr + c * 8), f);
      unpack8<DT>(ldg16(dr + c * 8), g);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        f[j] = round_dt<DT>(f[j] + g[j]);
        ss += f[j] * f[j];
      }
      V16 o;
      o.x = pack2<DT>(f[0], f[1]);
      o.y = pack2<DT>(f[2], f[3]);
      o.z = pack2<DT>(f[4], f[5]);
      o.w = pack2<DT>(f[6], f[7]);
      stg16(sr + c * 8, o);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if constexpr (TPR == 256) {
    __shared__ float part[8];
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    ss = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += part[i];
  }
  if (!live) return;
  const float r = rsqrtf(ss / (float)cols + eps);
  u16* yr = y + (i64)row * ldy;
  for (int c = tid; c < steps; c += TPR) {  // the sum again from x and d (s is not re-read)
    float f[8], g[8], h[8];
    unpack8<DT>(ldg16(xr + c * 8), f);
    unpack8<DT>(ldg16(dr + c * 8), h);
    unpack8<DT>(ldg16(w + c * 8), g);
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = g[j] * round_dt<DT>(round_dt<DT>(f[j] + h[j]) * r);
    V16 out;
    out.x = pack2<DT>(f[0], f[1]);
    out.y = pack2<DT>(f[2], f[3]);
    out.z = pack2<DT>(f[4], f[5]);
    out.w = pack2<DT>(f[6], f[7]);
    stg16(yr + c * 8, out);
  }
}
