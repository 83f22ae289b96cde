// The GPU side of a CPU-pool MoE layer in two kernels (ext/cuda/moe_stage.py).
//
// moe_route_stage_kernel: one block per token. Router softmax over the E logits (fp32, as
// torch.softmax of the logits cast to float), top-k by repeated block argmax (the lowest
// index wins a tie), optional renormalisation, then writes
//   - ids[t, j] (int64) and weights[t, j] (fp32) on the device (GPU-resident experts, counts),
//   - the pool's inputs straight into pinned host memory (zero-copy through UVA): hidden as
//     fp32, the CPU-routed ids (-1 where `local[e] >= 0`, the expert lives on the GPU) and the
//     weights,
//   - counts[e] += 1 per routed slot (routing statistics).
// It replaces the router's softmax/topk/sum/div kernels, the hidden and weight conversions and
// three device-to-host copies. Host visibility: the stream's next operation (the go word's
// write, which carries a system-wide memory barrier) orders these stores before the pool reads.
//
// moe_gather_kernel: out[t, :] (16-bit, on the device) = pool_out[t, :] (fp32, pinned host
// memory, read through UVA) + extra[t, :] (fp32, the GPU-resident experts' part; optional),
// rounded once; replaces a host-to-device copy, an add and a conversion.
#include "common.cuh"

constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 32;

template <int DT>
__device__ __forceinline__ float load16(const u16* p) {
  float lo, hi;
  unpack2<DT>((u32)*p, lo, hi);
  return lo;
}

// Block-wide (256 threads) max of (value, index): larger value, then lower index.
__device__ __forceinline__ void block_argmax(float& v, int& i, float* sv, int* si) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) {
    sv[warp] = v;
    si[warp] = i;
  }
  __syncthreads();
  v = sv[0];
  i = si[0];
#pragma unroll
  for (int w = 1; w < 8; ++w)
    if (sv[w] > v || (sv[w] == v && si[w] < i)) {
      v = sv[w];
      i = si[w];
    }
}

__device__ __forceinline__ float block_sum(float v, float* sv) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) sv[warp] = v;
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < 8; ++w) s += sv[w];
  return s;
}

template <int DT>
__global__ void __launch_bounds__(256) moe_route_stage_kernel(
    const u16* __restrict__ hidden, i64 ldh, const u16* __restrict__ logits, i64 ldl, int H,
    int E, int k, int renormalize, const i64* __restrict__ local, i64* __restrict__ ids_d,
    float* __restrict__ w_d, float* __restrict__ x_h, i64* __restrict__ ids_h,
    float* __restrict__ w_h, i64* __restrict__ counts) {
  __shared__ float p[kMaxExperts];
  __shared__ float sv[8];
  __shared__ int si[8];
  __shared__ float top_w[kMaxTopK];
  __shared__ int top_i[kMaxTopK];
  const int t = blockIdx.x;
  const u16* lr = logits + (i64)t * ldl;
  // softmax
  float m = neg_inf();
  for (int e = threadIdx.x; e < E; e += 256) {
    p[e] = load16<DT>(lr + e);
    m = fmaxf(m, p[e]);
  }
  int dummy = 0;
  block_argmax(m, dummy, sv, si);
  float s = 0.f;
  for (int e = threadIdx.x; e < E; e += 256) {
    p[e] = __expf(p[e] - m);
    s += p[e];
  }
  s = block_sum(s, sv);
  const float inv = 1.f / s;
  for (int e = threadIdx.x; e < E; e += 256) p[e] *= inv;
  __syncthreads();
  // top-k
  for (int j = 0; j < k; ++j) {
    float v = neg_inf();
    int i = 0x7fffffff;
    for (int e = threadIdx.x; e < E; e += 256)
      if (p[e] > v || (p[e] == v && e < i)) {
        v = p[e];
        i = e;
      }
    block_argmax(v, i, sv, si);
    if (threadIdx.x == 0) {
      top_w[j] = v;
      top_i[j] = i;
      p[i] = neg_inf();
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float sum = 0.f;
    for (int j = 0; j < k; ++j) sum += top_w[j];
    for (int j = 0; j < k; ++j) {
      const float w = renormalize ? top_w[j] / sum : top_w[j];
      const int e = top_i[j];
      ids_d[(i64)t * k + j] = e;
      w_d[(i64)t * k + j] = w;
      ids_h[(i64)t * k + j] = (local && local[e] >= 0) ? -1 : e;
      w_h[(i64)t * k + j] = w;
      if (counts) atomicAdd((unsigned long long*)(counts + e), 1ull);
    }
  }
  // hidden -> fp32, pinned
  const u16* hr = hidden + (i64)t * ldh;
  float* xr = x_h + (i64)t * H;
  for (int c = threadIdx.x; c < H; c += 256) xr[c] = load16<DT>(hr + c);
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
