// KV-cache write: copy each new token's K and V rows into its paged slot.
//
// One thread moves 16 bytes of K and 16 bytes of V. Thread i handles token i / chunks_per_token,
// KV head (i % chunks_per_token) / (D / 8), 8 elements at (i % (D / 8)) * 8. A negative slot
// means "skip this token" (padding rows of a CUDA-graph batch). Element-type agnostic: the
// bits are copied, so one kernel serves fp16 and bf16.
#include "common.cuh"

__global__ void __launch_bounds__(256) write_kv_kernel(
    u16* __restrict__ k_cache,               // [NB, BS, HKV, D]
    u16* __restrict__ v_cache,               // [NB, BS, HKV, D]
    const u16* __restrict__ k,               // [T, HKV, D] strides (k_stride_t, k_stride_h, 1)
    const u16* __restrict__ v,               // [T, HKV, D] strides (v_stride_t, v_stride_h, 1)
    const long long* __restrict__ slot_mapping,  // [T]
    int num_tokens, int num_kv_heads, int head_dim, i64 k_stride_t, i64 k_stride_h,
    i64 v_stride_t, i64 v_stride_h) {
  const int cph = head_dim >> 3;  // 16-byte chunks per head
  const int cpt = num_kv_heads * cph;
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (i64)num_tokens * cpt) return;
  const int t = (int)(i / cpt);
  const int rem = (int)(i - (i64)t * cpt);
  const int h = rem / cph;
  const int c = (rem - h * cph) * 8;
  const i64 slot = slot_mapping[t];
  if (slot < 0) return;
  const i64 dst = slot * num_kv_heads * head_dim + (i64)h * head_dim + c;
  const V16 kr = ldg16(k + t * k_stride_t + h * k_stride_h + c);
  const V16 vr = ldg16(v + t * v_stride_t + h * v_stride_h + c);
  stg16(k_cache + dst, kr);
  stg16(v_cache + dst, vr);
}
