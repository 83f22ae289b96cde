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
// PACKED: rows in the CPU pool's packed order (ext/cpu/kernels.h: packed_at), where the four
// elements [k, k + 4) of a block (k % 4 == 0) are one aligned 4-byte word (int8) or the low or
// high nibbles of one (int4): the thread reads its 16 elements as four such words.
// Requirements (checked by the launcher): K % 64 == 0, q and rows 8-byte aligned, out 16-byte.
#include "common.cuh"

// The word holding natural elements [k, k + 4) of a packed row of K elements (k % 4 == 0);
// *shift: 4 when they are the high nibbles (int4).
template <int FMT>
__device__ __forceinline__ u32 packed_word(const unsigned char* qr, int K, int k, int* shift) {
  const int sb = k / 512, rest = (K - sb * 512) / 32, m = rest < 16 ? rest : 16;
  const int l = (k % 512) / 32, i = k % 32;
  if constexpr (FMT == 1) {
    *shift = 0;
    return *reinterpret_cast<const u32*>(qr + sb * 512 + (i / 4) * 4 * m + 4 * l);
  } else {
    *shift = i >= 16 ? 4 : 0;
    return *reinterpret_cast<const u32*>(qr + sb * 256 + ((i % 16) / 4) * 4 * m + 4 * l);
  }
}

template <int FMT, int DT, bool PACKED>
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
    if constexpr (PACKED) {
      if constexpr (FMT == 1) {
        k_lo = u * 16;
        k_hi = k_lo + 8;
      } else {
        k_lo = (u / 4) * 64 + (u % 4) * 8;
        k_hi = k_lo + 32;
      }
      const float s_lo = FMT == 1 ? sr[0] : sr[k_lo / group];
      const float s_hi = FMT == 1 ? sr[0] : sr[k_hi / group];
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // elements k_lo + 4h.. and k_hi + 4h..
        int sl, sh;
        const u32 wl = packed_word<FMT>(qr, K, k_lo + 4 * h, &sl);
        const u32 wh = packed_word<FMT>(qr, K, k_hi + 4 * h, &sh);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const u32 bl = (wl >> (8 * j)) & 0xff, bh = (wh >> (8 * j)) & 0xff;
          if constexpr (FMT == 1) {
            lo[4 * h + j] = (float)(signed char)bl * s_lo;
            hi[4 * h + j] = (float)(signed char)bh * s_hi;
          } else {
            lo[4 * h + j] = (float)((int)((bl >> sl) & 15) - 8) * s_lo;
            hi[4 * h + j] = (float)((int)((bh >> sh) & 15) - 8) * s_hi;
          }
        }
      }
    } else if constexpr (FMT == 1) {
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
