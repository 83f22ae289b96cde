// The CPU expert pool's int8 / int4 rows (ext/cpu/layout.py) -> fp16/bf16 matrices, on the GPU.
// Used when a prefill-sized step computes the experts on the GPU from the pool's raw weights
// copied over PCIe (models/layers/gpu_prefill.py): the copy moves the packed bytes, this widens
// them in device memory at HBM speed.
//
// out[e][r][k] = value of row r of expert e, rounded once to DT (0 = fp16, 1 = bf16):
//   int8 (FMT 1): q[e][r][k] * s[e][r]
//   int4 (FMT 2): (nibble - 8) * s[e][r][k / group]; each 64-element chunk is 32 bytes, byte j
//                 holding element j (low nibble) and j + 32 (high).
// q rows are `row_bytes` apart inside an expert, experts `q_expert` bytes apart; scales
// likewise (`s_expert` floats an expert, `s_row` a row). One thread writes 16 elements: int8 two
// runs of 8 consecutive ones, int4 elements j..j+7 and j+32..j+39 of a chunk (one 8-byte load).
// Requirements (checked by the launcher): K % 64 == 0, q and rows 8-byte aligned, out 16-byte.
#include "common.cuh"

template <int FMT, int DT>
__global__ void __launch_bounds__(256) expert_dequant_kernel(
    const unsigned char* __restrict__ q, const float* __restrict__ s, u16* __restrict__ out,
    int E, int R, int K, i64 q_expert, i64 row_bytes, i64 s_expert, i64 s_row, int group) {
  const i64 per_row = K / 16;  // threads per row
  const i64 total = (i64)E * R * per_row;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (i64)gridDim.x * blockDim.x) {
    const i64 row = i / per_row;
    const int u = (int)(i - row * per_row);
    const int e = (int)(row / R), r = (int)(row - (i64)e * R);
    const unsigned char* qr = q + e * q_expert + r * row_bytes;
    const float* sr = s + e * s_expert + (i64)r * s_row;
    u16* o = out + row * K;
    float lo[8], hi[8];
    int k_lo, k_hi;
    if constexpr (FMT == 1) {
      k_lo = u * 16;
      k_hi = k_lo + 8;
      const uint2 a = *reinterpret_cast<const uint2*>(qr + k_lo);
      const uint2 b = *reinterpret_cast<const uint2*>(qr + k_hi);
      const float sc = sr[0];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        lo[j] = (float)(signed char)((a.x >> (8 * j)) & 0xff) * sc;
        lo[4 + j] = (float)(signed char)((a.y >> (8 * j)) & 0xff) * sc;
        hi[j] = (float)(signed char)((b.x >> (8 * j)) & 0xff) * sc;
        hi[4 + j] = (float)(signed char)((b.y >> (8 * j)) & 0xff) * sc;
      }
    } else {
      const int chunk = u / 4, j0 = (u % 4) * 8;
      k_lo = chunk * 64 + j0;
      k_hi = k_lo + 32;
      const uint2 a = *reinterpret_cast<const uint2*>(qr + chunk * 32 + j0);
      const float s_lo = sr[k_lo / group], s_hi = sr[k_hi / group];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u32 bx = (a.x >> (8 * j)) & 0xff, by = (a.y >> (8 * j)) & 0xff;
        lo[j] = (float)((int)(bx & 15) - 8) * s_lo;
        lo[4 + j] = (float)((int)(by & 15) - 8) * s_lo;
        hi[j] = (float)((int)(bx >> 4) - 8) * s_hi;
        hi[4 + j] = (float)((int)(by >> 4) - 8) * s_hi;
      }
    }
    V16 vl, vh;
    vl.x = pack2<DT>(lo[0], lo[1]);
    vl.y = pack2<DT>(lo[2], lo[3]);
    vl.z = pack2<DT>(lo[4], lo[5]);
    vl.w = pack2<DT>(lo[6], lo[7]);
    vh.x = pack2<DT>(hi[0], hi[1]);
    vh.y = pack2<DT>(hi[2], hi[3]);
    vh.z = pack2<DT>(hi[4], hi[5]);
    vh.w = pack2<DT>(hi[6], hi[7]);
    stg16(o + k_lo, vl);
    stg16(o + k_hi, vh);
  }
}
