// Multi-head latent attention (DeepSeek MLA, absorbed form) over a paged latent cache.
//
// Every query token attends with all its heads to its causal prefix of one shared latent
// "head": a cache row is [c (L) | k_pe (R)]; scores = q_latent . c + q_rope . k_pe, values = c.
// Grid (H / HM, tokens from tq0, num_parts), NW warps, one CTA per SM (dynamic shared memory).
// A CTA takes HM heads of one token and one split-KV partition of its context; decode and
// extend rows are the same work (an extend token's context ends at its own position).
//
// Per tile of N = 32 tokens (cp.async, STAGES-deep ring in shared memory):
//   QK: warp w owns 16 head rows (w % RW) and a slice of the L + R reduction dim (w / RW);
//       bf16 mma.sync (8 warps keep most Q fragments in registers), partial scores summed
//       through shared memory.
//   softmax: 32 NW / HM threads per row, all rows at once; online max/sum in the log2 domain.
//   PV: warp w owns L / NW output columns of all HM rows (fp32 accumulators in registers),
//       P (bf16) and the tile's c rows read with ldmatrix from shared memory.
// A token whose context fits one partition writes `out`; otherwise each partition writes its
// normalised partial output and log2-sum-exp, merged by mla_combine_kernel.
// Throughput limit (docs/mla.md): shared-memory operand traffic of mma.sync, with 64 heads.
#include "common.cuh"

struct alignas(8) F2 {
  float x, y;
};
struct alignas(16) F4 {
  float x, y, z, w;
};

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

constexpr int MLA_N = 32;  // tokens per tile (= one lane per token in the softmax)
constexpr int MLA_STAGES = 3;

template <int L, int R, int RW, int NW>
struct MlaSmem {
  static constexpr int D = L + R;
  static constexpr int HM = 16 * RW;
  static constexpr int KSPLIT = NW / RW;
  static constexpr int RS = D + 8;       // row stride (halves): odd 16-byte units, no conflicts
  static constexpr int PS = MLA_N + 8;   // P row stride (halves)
  static constexpr int SS = MLA_N + 4;   // partial-score row stride (floats)
  static constexpr int Q_OFF = 0;
  static constexpr int K_OFF = Q_OFF + HM * RS * 2;
  static constexpr int P_OFF = K_OFF + MLA_STAGES * MLA_N * RS * 2;
  static constexpr int S_OFF = P_OFF + HM * PS * 2;
  static constexpr int M_OFF = S_OFF + KSPLIT * HM * SS * 4;
  static constexpr int BYTES = M_OFF + 3 * HM * 4;
};

template <int DT, int L, int R, int RW, int NW>
__global__ void __launch_bounds__(NW * 32, 1) mla_attention_kernel(
    u16* __restrict__ out,              // [T, H, L] contiguous
    float* __restrict__ part_out,       // [T, H, NP, L] (only when num_parts > 1)
    float* __restrict__ part_lse,       // [T, H, NP]
    const u16* __restrict__ q_lat,      // [T, H, L], strides (ql_t, ql_h, 1)
    const u16* __restrict__ q_rope,     // [T, H, R], strides (qr_t, qr_h, 1)
    const u16* __restrict__ cache,      // [NB, BS, L + R] contiguous
    const int* __restrict__ qsl,        // [S + 1]
    const int* __restrict__ seq_lens,   // [S]
    const int* __restrict__ block_tables,  // [S, bt_stride]
    int tq0, int num_seqs, int num_heads, i64 ql_t, i64 ql_h, i64 qr_t, i64 qr_h,
    int bt_stride, int bs_shift, int part_len, int num_parts, float scale_log2) {
  using SM = MlaSmem<L, R, RW, NW>;
  constexpr int MLA_THREADS = NW * 32;
  constexpr int D = SM::D, HM = SM::HM, KSPLIT = SM::KSPLIT;
  constexpr int RS = SM::RS, PS = SM::PS, SS = SM::SS;
  constexpr int N = MLA_N, STAGES = MLA_STAGES;
  constexpr int C8 = D / 8;      // 16-byte chunks per row
  constexpr int KS = D / 16;     // k-steps of the score product
  constexpr int CW = L / NW;     // output columns per warp
  constexpr int NTW = CW / 8;    // n8 tiles per warp
  static_assert(L % (16 * NW) == 0 && R % 16 == 0, "L must be a multiple of 16 NW, R of 16");

  extern __shared__ __align__(16) unsigned char smem[];
  u16* sQ = reinterpret_cast<u16*>(smem + SM::Q_OFF);
  u16* sK = reinterpret_cast<u16*>(smem + SM::K_OFF);
  u16* sP = reinterpret_cast<u16*>(smem + SM::P_OFF);
  float* sS = reinterpret_cast<float*>(smem + SM::S_OFF);
  float* sM = reinterpret_cast<float*>(smem + SM::M_OFF);
  float* sL = sM + HM;
  float* sC = sL + HM;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int head0 = blockIdx.x * HM;
  const int tq = tq0 + blockIdx.y;
  const int part = blockIdx.z;

  int seq;
  const int ctx = token_context(qsl, seq_lens, num_seqs, tq, seq);
  if (ctx <= 0) {  // padded row: defined output, no NaN
    if (part == 0) {
      for (int i = tid; i < HM * L / 8; i += MLA_THREADS) {
        const int row = i / (L / 8), c8 = i % (L / 8);
        stg16(out + ((i64)tq * num_heads + head0 + row) * L + c8 * 8, V16{0, 0, 0, 0});
      }
    }
    return;
  }
  const int start = part * part_len;
  if (start >= ctx) return;
  const int end = min(ctx, start + part_len);
  const int token_parts = (ctx + part_len - 1) / part_len;
  const int ntiles = (end - start + N - 1) / N;
  const int* bt = block_tables + (i64)seq * bt_stride;
  const int bs_mask = (1 << bs_shift) - 1;

  // Q rows [q_latent | q_rope] of this CTA's heads (its own commit group, first).
  for (int i = tid; i < HM * C8; i += MLA_THREADS) {
    const int row = i / C8, c8 = i % C8;
    const u16* src = c8 < L / 8
        ? q_lat + (i64)tq * ql_t + (i64)(head0 + row) * ql_h + c8 * 8
        : q_rope + (i64)tq * qr_t + (i64)(head0 + row) * qr_h + (c8 - L / 8) * 8;
    cp_async16(smem_addr(sQ + row * RS + c8 * 8), src, true);
  }
  cp_async_commit();

  auto load_tile = [&](int tile) {
    const int t0 = start + tile * N;
    u16* dst = sK + (tile % STAGES) * N * RS;
#pragma unroll
    for (int j = 0; j < (N * C8 + MLA_THREADS - 1) / MLA_THREADS; ++j) {
      const int i = tid + j * MLA_THREADS;
      if (i < N * C8) {
        const int r = i / C8, c8 = i % C8;
        const int t = t0 + r;
        const bool ok = t < end;
        const u16* src = cache;
        if (ok) {
          const i64 slot = ((i64)bt[t >> bs_shift] << bs_shift) + (t & bs_mask);
          src = cache + slot * D + c8 * 8;
        }
        cp_async16(smem_addr(dst + r * RS + c8 * 8), src, ok);  // zero-fill past the end
      }
    }
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ntiles) load_tile(s);
    cp_async_commit();
  }
  constexpr int TPR = MLA_THREADS / HM;  // softmax: threads per row (4 to 16)
  constexpr int TPT = N / TPR;           // softmax: tokens per thread (8 to 2)
  static_assert(TPR <= 16 && (TPT == 2 || TPT == 4 || TPT == 8), "softmax layout");
  const int srow = tid / TPR, sq = tid % TPR;
  float row_m = neg_inf(), row_l = 0.f;  // the row's running max (log2 domain) and sum

  const int g = lane >> 2, t4 = lane & 3;
  const int wr = warp % RW;       // QK: 16-row group
  const int wk = warp / RW;       // QK: slice of the reduction dim
  constexpr int KPW = (KS + KSPLIT - 1) / KSPLIT;  // k-steps per slice (the last may be short)
  const int ks0 = wk * KPW;

  // With 8 warps (255 registers) each warp keeps its Q fragments (16 rows x its k-slice) in
  // registers for the whole context: the score product then reads only K from shared memory.
  constexpr int QR = NW == 8 ? (KPW < 10 ? KPW : 10) : 0;  // k-steps held (register budget)
  constexpr bool QREG = QR > 0;
  u32 qf[QREG ? QR : 1][4];
  if constexpr (QREG) {
    cp_async_wait<STAGES - 1>();  // the Q group, committed first, has landed
    __syncthreads();
    const u32 q_base = smem_addr(sQ + (wr * 16 + (lane & 15)) * RS + (lane >> 4) * 8);
#pragma unroll
    for (int i = 0; i < QR; ++i) {
      const int ks = min(ks0 + i, KS - 1);
      ldmatrix_x4(q_base + ks * 32, qf[i][0], qf[i][1], qf[i][2], qf[i][3]);
    }
  }

  float acc[RW][NTW][4];
#pragma unroll
  for (int mi = 0; mi < RW; ++mi)
#pragma unroll
    for (int n = 0; n < NTW; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][n][e] = 0.f;

  for (int it = 0; it < ntiles; ++it) {
    // Tile `it` landed and every warp left iteration it - 1: its stage, P and the partial
    // scores may be rewritten.
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (it + STAGES - 1 < ntiles) load_tile(it + STAGES - 1);
    cp_async_commit();
    const u16* kt = sK + (it % STAGES) * N * RS;

    // ---- partial scores of 16 rows x N tokens over k-steps [ks0, ks1)
    float s[N / 8][4];
#pragma unroll
    for (int n = 0; n < N / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
    const u32 a_base = smem_addr(sQ + (wr * 16 + (lane & 15)) * RS + (lane >> 4) * 8);
    const u32 b_base =
        smem_addr(kt + ((lane & 7) + ((lane >> 4) << 3)) * RS + ((lane >> 3) & 1) * 8);
#pragma unroll
    for (int i = 0; i < KPW; ++i) {
      const int ks = ks0 + i;
      if (KS % KSPLIT != 0 && ks >= KS) break;
      u32 a[4];
      if (i < QR) {
        a[0] = qf[QREG ? i : 0][0];
        a[1] = qf[QREG ? i : 0][1];
        a[2] = qf[QREG ? i : 0][2];
        a[3] = qf[QREG ? i : 0][3];
      } else {
        ldmatrix_x4(a_base + ks * 32, a[0], a[1], a[2], a[3]);
      }
#pragma unroll
      for (int np = 0; np < N / 16; ++np) {
        u32 b0, b1, b2, b3;
        ldmatrix_x4(b_base + (np * 16 * RS + ks * 16) * 2, b0, b1, b2, b3);
        mma16816<DT>(s[2 * np], a, b0, b1);
        mma16816<DT>(s[2 * np + 1], a, b2, b3);
      }
    }
    {
      // Row r's columns are rotated by 4 (r % 8): the 4 rows of a half warp's stores start
      // 8 banks apart (no conflicts); 4-float groups stay contiguous for the vector loads.
      float* ss = sS + (wk * HM + wr * 16) * SS;
#pragma unroll
      for (int n = 0; n < N / 8; ++n) {
        const int c = (n * 8 + 2 * t4 + 4 * g) & (N - 1);
        *reinterpret_cast<F2*>(ss + g * SS + c) = F2{s[n][0], s[n][1]};
        *reinterpret_cast<F2*>(ss + (g + 8) * SS + c) = F2{s[n][2], s[n][3]};
      }
    }
    __syncthreads();

    // ---- online softmax: TPR threads per row, TPT consecutive tokens each, all rows at once
    {
      const int tok0 = start + it * N + sq * TPT;
      float x[TPT];
#pragma unroll
      for (int j = 0; j < TPT; ++j) x[j] = 0.f;
#pragma unroll
      for (int k = 0; k < KSPLIT; ++k) {  // vector loads: a quarter warp reads 128 B in a row
        const float* src = sS + (k * HM + srow) * SS;
        const int rot = 4 * (srow & 7);
        if constexpr (TPT % 4 == 0) {
#pragma unroll
          for (int j = 0; j < TPT; j += 4) {
            const F4 v = *reinterpret_cast<const F4*>(src + ((sq * TPT + j + rot) & (N - 1)));
            x[j] += v.x;
            x[j + 1] += v.y;
            x[j + 2] += v.z;
            x[j + 3] += v.w;
          }
        } else {
#pragma unroll
          for (int j = 0; j < TPT; j += 2) {
            const F2 v = *reinterpret_cast<const F2*>(src + ((sq * TPT + j + rot) & (N - 1)));
            x[j] += v.x;
            x[j + 1] += v.y;
          }
        }
      }
      float mx = neg_inf();
#pragma unroll
      for (int j = 0; j < TPT; ++j) {
        x[j] = tok0 + j < end ? x[j] * scale_log2 : neg_inf();
        mx = fmaxf(mx, x[j]);
      }
#pragma unroll
      for (int o = TPR / 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = fmaxf(row_m, mx);  // finite: a tile's first token is always valid
      const float corr = exp2f(row_m - m_new);
      float psum = 0.f;
      u32 packed[TPT / 2];
#pragma unroll
      for (int j = 0; j < TPT; j += 2) {
        const float p0 = exp2f(x[j] - m_new), p1 = exp2f(x[j + 1] - m_new);
        psum += p0 + p1;
        packed[j / 2] = pack2<DT>(p0, p1);
      }
#pragma unroll
      for (int o = TPR / 2; o > 0; o >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, o);
      row_m = m_new;
      row_l = row_l * corr + psum;
      u16* dstp = sP + srow * PS + sq * TPT;
      if constexpr (TPT == 8) {
        *reinterpret_cast<V16*>(dstp) = V16{packed[0], packed[1], packed[2], packed[3]};
      } else if constexpr (TPT == 4) {
        *reinterpret_cast<F2*>(dstp) =
            F2{__uint_as_float(packed[0]), __uint_as_float(packed[1])};
      } else {
        *reinterpret_cast<u32*>(dstp) = packed[0];
      }
      if (sq == 0) sC[srow] = corr;
    }
    __syncthreads();

    // ---- O[HM, warp's columns] = O * corr + P @ c
#pragma unroll
    for (int mi = 0; mi < RW; ++mi) {
      const float c0 = sC[mi * 16 + g], c1 = sC[mi * 16 + g + 8];
#pragma unroll
      for (int n = 0; n < NTW; ++n) {
        acc[mi][n][0] *= c0;
        acc[mi][n][1] *= c0;
        acc[mi][n][2] *= c1;
        acc[mi][n][3] *= c1;
      }
    }
    const u32 v_base = smem_addr(kt + ((lane & 7) + ((lane >> 3) & 1) * 8) * RS + warp * CW +
                                 (lane >> 4) * 8);
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
      u32 a[RW][4];
#pragma unroll
      for (int mi = 0; mi < RW; ++mi)
        ldmatrix_x4(smem_addr(sP + (mi * 16 + (lane & 15)) * PS + kk * 16 + (lane >> 4) * 8),
                    a[mi][0], a[mi][1], a[mi][2], a[mi][3]);
#pragma unroll
      for (int np = 0; np < NTW / 2; ++np) {
        u32 b0, b1, b2, b3;
        ldmatrix_x4_trans(v_base + (kk * 16 * RS + np * 16) * 2, b0, b1, b2, b3);
#pragma unroll
        for (int mi = 0; mi < RW; ++mi) {
          mma16816<DT>(acc[mi][2 * np], a[mi], b0, b1);
          mma16816<DT>(acc[mi][2 * np + 1], a[mi], b2, b3);
        }
      }
    }
  }
  cp_async_wait<0>();
  if (sq == 0) {
    sM[srow] = row_m;
    sL[srow] = row_l;
  }
  __syncthreads();

  // ---- normalise and store
#pragma unroll
  for (int mi = 0; mi < RW; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = mi * 16 + g + h * 8;
      const float l = sL[row];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const i64 head = head0 + row;
#pragma unroll
      for (int n = 0; n < NTW; ++n) {
        const int col = warp * CW + n * 8 + 2 * t4;
        const float o0 = acc[mi][n][2 * h] * inv, o1 = acc[mi][n][2 * h + 1] * inv;
        if (token_parts == 1) {
          *reinterpret_cast<u32*>(out + ((i64)tq * num_heads + head) * L + col) =
              pack2<DT>(o0, o1);
        } else {
          const i64 prow = ((i64)tq * num_heads + head) * num_parts + part;
          *reinterpret_cast<F2*>(part_out + prow * L + col) = F2{o0, o1};
        }
      }
    }
  }
  if (token_parts > 1 && tid < HM) {
    const float l = sL[tid];
    part_lse[((i64)tq * num_heads + head0 + tid) * num_parts + part] =
        l > 0.f ? sM[tid] + log2f(l) : neg_inf();
  }
}

// Merge split-KV partitions of one (token, head): out = sum_p w_p o_p / sum_p w_p with
// w_p = 2^(lse_p - max lse). Grid (H, tokens from tq0), 128 threads; rows of one partition are skipped
// (written directly by the attention kernel).
constexpr int MLA_MAX_PARTS = 128;

template <int DT, int L>
__global__ void __launch_bounds__(128) mla_combine_kernel(
    u16* __restrict__ out, const float* __restrict__ part_out,
    const float* __restrict__ part_lse, const int* __restrict__ qsl,
    const int* __restrict__ seq_lens, int tq0, int num_seqs, int num_heads, int part_len,
    int num_parts) {
  __shared__ float w[MLA_MAX_PARTS];
  const int head = blockIdx.x;
  const int tq = tq0 + blockIdx.y;
  int seq;
  const int ctx = token_context(qsl, seq_lens, num_seqs, tq, seq);
  const int np = ctx > 0 ? (ctx + part_len - 1) / part_len : 0;
  if (np <= 1) return;
  const i64 row = ((i64)tq * num_heads + head) * num_parts;
  float M = neg_inf();
  for (int p = 0; p < np; ++p) M = fmaxf(M, part_lse[row + p]);
  float wsum = 0.f;
  for (int p = 0; p < np; ++p) {
    const float lp = part_lse[row + p];
    const float wp = lp == neg_inf() ? 0.f : exp2f(lp - M);
    wsum += wp;
    if (threadIdx.x == 0) w[p] = wp;
  }
  __syncthreads();
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  for (int c = threadIdx.x; c < L; c += blockDim.x) {
    float o = 0.f;
    for (int p = 0; p < np; ++p) o = fmaf(w[p], part_out[(row + p) * L + c], o);
    out[((i64)tq * num_heads + head) * L + c] = from_float<DT>(o * inv);
  }
}
