// Qwen3-style attention prologue in one kernel: per-head q/k RMSNorm, neox rotary, and the
// paged KV write, straight from the fused qkv projection's output.
//
// One warp per (token, head) of the qkv row: query heads are normalized (q_w), rotated and
// written to q_out [T, H, D]; key heads are normalized (k_w), rotated and written to their
// paged slot in k_cache; value heads are copied to v_cache (a negative slot skips the token:
// padding rows of a CUDA-graph batch). Lane l holds elements l, l + 32, ... of a head, so the
// rotary partners j and j + D/2 sit in the same lane.
//
// Rounding follows the torch expression it replaces (models/layers/attention.py): the norm as
// HF's RMSNorm (fp32 statistics, the normalized value rounded, times the weight, rounded), then
// `x * cos + rotate_half(x) * sin` with every product and the sum rounded to the model dtype.
// It replaces two norms' kernels, ten rotary kernels and the KV write of a layer.
// NORM = 0: no norms (Llama-style attention after a projection the skinny kernel does not fuse,
// such as a packed GGUF one): rotary and the KV write only; q_w and k_w are not read.
#include "common.cuh"

template <int DT, int D, int NORM = 1>
__global__ void __launch_bounds__(256) qk_norm_rope_kernel(
    const u16* __restrict__ qkv, i64 ldq, const u16* __restrict__ q_w,
    const u16* __restrict__ k_w, const u16* __restrict__ cos, const u16* __restrict__ sin,
    i64 ldc, u16* __restrict__ q_out, u16* __restrict__ k_cache, u16* __restrict__ v_cache,
    const long long* __restrict__ slot_mapping, int T, int H, int KVH, float eps) {
  constexpr int M = D / 32;  // elements per lane
  pdl_wait();  // launched with programmatic dependent launch
  pdl_trigger();
  const int lane = threadIdx.x & 31;
  const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int heads = H + 2 * KVH;
  if (warp >= (i64)T * heads) return;
  const int t = (int)(warp / heads), h = (int)(warp - (i64)t * heads);
  const u16* src = qkv + (i64)t * ldq + (i64)h * D;
  const long long slot = slot_mapping[t];
  if (h >= H + KVH) {  // value head: copy into the cache
    if (slot < 0) return;
    u16* dst = v_cache + slot * KVH * D + (i64)(h - H - KVH) * D;
#pragma unroll
    for (int m = 0; m < M; ++m) dst[lane + 32 * m] = src[lane + 32 * m];
    return;
  }
  const bool is_q = h < H;
  if (!is_q && slot < 0) return;
  float f[M];
  float ss = 0.f;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    f[m] = ld_f<DT>(src + lane + 32 * m);
    ss += f[m] * f[m];
  }
  if constexpr (NORM) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float r = rsqrtf(ss / (float)D + eps);
    const u16* w = is_q ? q_w : k_w;
#pragma unroll
    for (int m = 0; m < M; ++m) f[m] = round_dt<DT>(ld_f<DT>(w + lane + 32 * m) * round_dt<DT>(f[m] * r));
  }
  const u16* cr = cos + (i64)t * ldc;
  const u16* sr = sin + (i64)t * ldc;
  u16* dst = is_q ? q_out + ((i64)t * H + h) * D : k_cache + slot * KVH * D + (i64)(h - H) * D;
#pragma unroll
  for (int m = 0; m < M / 2; ++m) {
    const int j = lane + 32 * m, j2 = j + D / 2;
    const float a = f[m], b = f[m + M / 2];
    const float oa = round_dt<DT>(round_dt<DT>(a * ld_f<DT>(cr + j)) + round_dt<DT>(-b * ld_f<DT>(sr + j)));
    const float ob = round_dt<DT>(round_dt<DT>(b * ld_f<DT>(cr + j2)) + round_dt<DT>(a * ld_f<DT>(sr + j2)));
    dst[j] = from_float<DT>(oa);
    dst[j2] = from_float<DT>(ob);
  }
}
