// The GPU side of a CPU-pool MoE layer in two kernels (ext/cuda/moe_stage.py).
//
// moe_route_stage_kernel: one block per token. Warp 0: router softmax over the E logits (fp32,
// as torch.softmax of the logits cast to float), top-k (k <= 32) by repeated warp argmax (the
// lowest index wins a tie), optional renormalisation; all warps convert the hidden row. Writes
//   - ids[t, j] (int64) and weights[t, j] (fp32) on the device (GPU-resident experts, counts),
//   - the pool's inputs straight into pinned host memory (zero-copy through UVA): hidden as
//     fp32, the CPU-routed ids (-1 where `local[e] >= 0`, the expert lives on the GPU) and the
//     weights,
//   - counts[e] += 1 per routed slot (routing statistics).
// It replaces the router's softmax/topk/sum/div kernels, the hidden and weight conversions and
// three device-to-host copies. Host visibility: the stream's next operation (the go word's
// write, which carries a system-wide memory barrier) orders these stores before the pool reads.
//
// moe_route_sort_kernel: the router of a decode-sized step with every expert on the GPU, and
// its slots sorted by expert (below).
//
// moe_gather_kernel: out[t, :] (16-bit, on the device) = pool_out[t, :] (fp32, pinned host
// memory, read through UVA) + extra[t, :] (fp32, the GPU-resident experts' part; optional),
// rounded once; replaces a host-to-device copy, an add and a conversion.
#include "common.cuh"

constexpr int kMaxExperts = 1024;

// One token's router in one warp: softmax over the E logits (fp32, as torch.softmax of the
// logits cast to float), top-k (k <= 32) by k rounds of a warp argmax (the lowest index wins a
// tie), optional renormalisation. p: E floats of scratch owned by this warp. Lane j < k gets
// the j-th expert and its weight. Element e lives in lane e % 32 (it alone reads and clears
// p[e]), so no barrier is needed.
template <int DT>
__device__ __forceinline__ void warp_route(const u16* __restrict__ lr, int E, int k,
                                           int renormalize, float* p, int lane, int& my_i,
                                           float& my_w) {
  float m = neg_inf();
  for (int e = lane; e < E; e += 32) {
    p[e] = ld_f<DT>(lr + e);
    m = fmaxf(m, p[e]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float s = 0.f;
  for (int e = lane; e < E; e += 32) {
    p[e] = __expf(p[e] - m);
    s += p[e];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const float inv = 1.f / s;
  for (int e = lane; e < E; e += 32) p[e] *= inv;
  my_w = 0.f;
  my_i = 0;
  for (int j = 0; j < k; ++j) {
    float v = neg_inf();
    int i = 0x7fffffff;
    for (int e = lane; e < E; e += 32)
      if (p[e] > v) {  // e ascends: the first of equal values wins
        v = p[e];
        i = e;
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, i, o);
      if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
      }
    }
    if (lane == j) {
      my_w = v;
      my_i = i;
    }
    if ((i & 31) == lane) p[i] = neg_inf();
  }
  float sum = lane < k ? my_w : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (renormalize) my_w /= sum;
}

template <int DT>
__global__ void __launch_bounds__(256) moe_route_stage_kernel(
    const u16* __restrict__ hidden, i64 ldh, const u16* __restrict__ logits, i64 ldl, int H,
    int E, int k, int renormalize, const i64* __restrict__ local, i64* __restrict__ ids_d,
    float* __restrict__ w_d, float* __restrict__ x_h, i64* __restrict__ ids_h,
    float* __restrict__ w_h, i64* __restrict__ counts) {
  __shared__ float p[kMaxExperts];
  const int t = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // every warp: hidden -> fp32, pinned host memory
  const u16* hr = hidden + (i64)t * ldh;
  float* xr = x_h + (i64)t * H;
  for (int c = threadIdx.x; c < H; c += 256) xr[c] = ld_f<DT>(hr + c);
  if (warp != 0) return;
  int my_i;
  float my_w;
  warp_route<DT>(logits + (i64)t * ldl, E, k, renormalize, p, lane, my_i, my_w);
  if (lane < k) {
    const i64 o = (i64)t * k + lane;
    ids_d[o] = my_i;
    w_d[o] = my_w;
    ids_h[o] = (local && local[my_i] >= 0) ? -1 : my_i;
    w_h[o] = my_w;
    if (counts) atomicAdd((unsigned long long*)(counts + my_i), 1ull);
  }
}

// The router of a decode-sized step with every expert on the GPU (ext/cuda/skinny.py:
// moe_decode_experts), in one block: warp w routes tokens w, w + 8, ... (warp_route) into
// ids / weights [T, k]; then the S = T * k slots are sorted by expert, stably (slot s's rank
// counts the slots with a smaller id, or the same id and a smaller slot), into sorted_ids and
// order [S], the inputs of moe_gemv_kernel. S <= kMaxSlots.
constexpr int kMaxSlots = 256;
constexpr int kRouteWarps = 8;

template <int DT>
__global__ void __launch_bounds__(256) moe_route_sort_kernel(
    const u16* __restrict__ logits, i64 ldl, int T, int E, int k, int renormalize,
    i64* __restrict__ ids, float* __restrict__ weights, i64* __restrict__ sorted_ids,
    i64* __restrict__ order) {
  __shared__ float p[kRouteWarps][kMaxExperts];
  __shared__ int slot_id[kMaxSlots];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int t = warp; t < T; t += kRouteWarps) {
    int my_i;
    float my_w;
    warp_route<DT>(logits + (i64)t * ldl, E, k, renormalize, p[warp], lane, my_i, my_w);
    if (lane < k) {
      ids[t * k + lane] = my_i;
      weights[t * k + lane] = my_w;
      slot_id[t * k + lane] = my_i;
    }
  }
  __syncthreads();
  const int S = T * k;
  for (int s = threadIdx.x; s < S; s += blockDim.x) {
    const int e = slot_id[s];
    int rank = 0;
    for (int o = 0; o < S; ++o) {
      const int f = slot_id[o];
      rank += (f < e) || (f == e && o < s);
    }
    sorted_ids[rank] = e;
    order[rank] = s;
  }
}

template <int DT>
__global__ void __launch_bounds__(256) moe_gather_kernel(const float* __restrict__ pool_out,
                                                         const float* __restrict__ extra,
                                                         u16* __restrict__ out, i64 n) {
  for (i64 i = (i64)blockIdx.x * 256 + threadIdx.x; i < n; i += (i64)gridDim.x * 256) {
    float v = pool_out[i];
    if (extra) v += extra[i];
    out[i] = from_float<DT>(v);
  }
}
