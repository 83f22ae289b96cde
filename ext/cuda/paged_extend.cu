// Extend (prefill) attention over a paged KV cache, tensor cores via mma.sync m16n8k16.
//
// The new tokens of each sequence attend causally to themselves and to the sequence's paged
// prefix (their own K/V are already written). Rows of a query tile are (token, head) pairs of
// the GROUP query heads that share one KV head — row r is token r / group, head
// kvh * group + r % group — so one K/V tile in shared memory serves the whole group.
// Grid (ceil(max_query_len * group / 64), num_seqs, num_kv_heads), 128 threads: 4 warps of
// 16 rows each; KV tiles of 64 tokens loaded with cp.async (K and V in separate groups so
// Q.K^T starts while V is in flight); online softmax in fp32, P.V with P rounded to 16 bits.
// A sliding-window layer (`window` > 0): a row at position p sees keys p - window + 1 .. p, and
// the CTA's key tiles start at its first row's window (tokens before it are never read, so
// released blocks behind the window may sit in the table). Learned per-head sinks (`sinks`,
// natural-log logits, may be null) join each row's softmax denominator at the end.
#include "common.cuh"

template <int DT, int D>
__global__ void __launch_bounds__(128) paged_extend_kernel(
    u16* __restrict__ out,                    // [T, H, D] contiguous
    const u16* __restrict__ q,                // [T, H, D] strides (q_stride_t, q_stride_h, 1)
    const u16* __restrict__ k_cache,          // [NB, BS, HKV, D]
    const u16* __restrict__ v_cache,          // [NB, BS, HKV, D]
    const int* __restrict__ query_start_loc,  // [S + 1]
    const int* __restrict__ seq_lens,         // [S]
    const int* __restrict__ block_tables,     // [S, bt_stride]
    const float* __restrict__ sinks,          // [H] or null
    int num_heads, int num_kv_heads, int group, int q_stride_t, int q_stride_h, int bt_stride,
    int bs_shift, int window, float scale_log2) {
  constexpr int BM = 64;       // query rows per CTA
  constexpr int BN = 64;       // KV tokens per tile
  constexpr int LDS = D + 8;   // padded smem row (16 bytes) -> conflict-free ldmatrix
  constexpr int KS = D / 16;   // k-steps over head_dim
  constexpr int NTS = BN / 8;  // n-tiles of S
  constexpr int NTO = D / 8;   // n-tiles of O
  alignas(16) __shared__ u16 ks_[BN * LDS];
  alignas(16) __shared__ u16 vs_[BN * LDS];

  const int seq = blockIdx.y;
  const int kvh = blockIdx.z;
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  const int rows = q_len * group;
  const int row0 = blockIdx.x * BM;
  if (row0 >= rows) return;
  const int seq_len = seq_lens[seq];
  const int ctx = seq_len - q_len;

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, gid = lane >> 2, tig = lane & 3;

  // This thread's two rows (gid and gid + 8 of the warp's 16).
  int pos[2];
  i64 q_off[2], o_off[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = row0 + warp * 16 + gid + i * 8;
    if (r < rows) {
      const int tok = r / group;
      const int head = kvh * group + r % group;
      pos[i] = ctx + tok;
      q_off[i] = (i64)(q_start + tok) * q_stride_t + (i64)head * q_stride_h;
      o_off[i] = ((i64)(q_start + tok) * num_heads + head) * D;
    } else {
      pos[i] = -1;  // masks every key: l stays 0 and the row is not written
      q_off[i] = 0;
      o_off[i] = -1;
    }
  }

  u32 qa[KS][4];
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    const int c = kk * 16 + tig * 2;
    qa[kk][0] = pos[0] >= 0 ? *(const u32*)(q + q_off[0] + c) : 0u;
    qa[kk][1] = pos[1] >= 0 ? *(const u32*)(q + q_off[1] + c) : 0u;
    qa[kk][2] = pos[0] >= 0 ? *(const u32*)(q + q_off[0] + c + 8) : 0u;
    qa[kk][3] = pos[1] >= 0 ? *(const u32*)(q + q_off[1] + c + 8) : 0u;
  }

  // keys at or before win_lo[i] are outside row i's window (-1: no window)
  const int win_lo[2] = {window > 0 ? pos[0] - window : -1, window > 0 ? pos[1] - window : -1};

  const int last_row = min(rows, row0 + BM) - 1;
  const int kv_end = min(seq_len, ctx + last_row / group + 1);
  // first key the CTA's first row sees (later rows see no earlier key)
  const int kv_lo = window > 0 ? max(0, ctx + row0 / group - window + 1) : 0;

  float o[NTO][4];
#pragma unroll
  for (int n = 0; n < NTO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {neg_inf(), neg_inf()};
  float l[2] = {0.f, 0.f};

  const i64 slot_stride = (i64)num_kv_heads * D;
  const int* bt = block_tables + (i64)seq * bt_stride;
  const int bs_mask = (1 << bs_shift) - 1;
  const u32 ks_base = smem_addr(ks_);
  const u32 vs_base = smem_addr(vs_);
  constexpr int CPR = D / 8;  // 16-byte chunks per row

  // ldmatrix lane addressing
  const int lm_mat = lane >> 3, lm_row = lane & 7;

  for (int kv0 = kv_lo; kv0 < kv_end; kv0 += BN) {
    __syncthreads();  // previous tile fully consumed
#pragma unroll
    for (int c = tid; c < BN * CPR; c += 128) {
      const int rr = c / CPR, cc = c % CPR;
      const int t = kv0 + rr;
      const bool ok = t < kv_end;
      const u16* src = k_cache;
      if (ok) {
        const i64 slot = ((i64)bt[t >> bs_shift] << bs_shift) + (t & bs_mask);
        src = k_cache + slot * slot_stride + (i64)kvh * D + cc * 8;
      }
      cp_async16(ks_base + (rr * LDS + cc * 8) * 2, src, ok);
    }
    cp_async_commit();
#pragma unroll
    for (int c = tid; c < BN * CPR; c += 128) {
      const int rr = c / CPR, cc = c % CPR;
      const int t = kv0 + rr;
      const bool ok = t < kv_end;
      const u16* src = v_cache;
      if (ok) {
        const i64 slot = ((i64)bt[t >> bs_shift] << bs_shift) + (t & bs_mask);
        src = v_cache + slot * slot_stride + (i64)kvh * D + cc * 8;
      }
      cp_async16(vs_base + (rr * LDS + cc * 8) * 2, src, ok);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    // S = Q K^T  [16 rows x 64 tokens] per warp
    float s[NTS][4];
#pragma unroll
    for (int n = 0; n < NTS; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
      for (int np = 0; np < NTS / 2; ++np) {
        const int tok = np * 16 + (lm_mat >> 1) * 8 + lm_row;
        const int dim = kk * 16 + (lm_mat & 1) * 8;
        u32 b0, b1, b2, b3;
        ldmatrix_x4(ks_base + (tok * LDS + dim) * 2, b0, b1, b2, b3);
        mma16816<DT>(s[2 * np], qa[kk], b0, b1);
        mma16816<DT>(s[2 * np + 1], qa[kk], b2, b3);
      }
    }

    // causal + length mask, online softmax (rows gid and gid + 8)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = neg_inf();
#pragma unroll
      for (int n = 0; n < NTS; ++n) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int col = kv0 + n * 8 + tig * 2 + j;
          float v = s[n][2 * i + j] * scale_log2;
          if (col > pos[i] || col <= win_lo[i]) v = neg_inf();
          s[n][2 * i + j] = v;
          mx = fmaxf(mx, v);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[i], mx);
      const float base = (m_new == neg_inf()) ? 0.f : m_new;
      const float corr = exp2f(m[i] - base);
      l[i] *= corr;
#pragma unroll
      for (int n = 0; n < NTO; ++n) {
        o[n][2 * i] *= corr;
        o[n][2 * i + 1] *= corr;
      }
#pragma unroll
      for (int n = 0; n < NTS; ++n) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float p = exp2f(s[n][2 * i + j] - base);
          s[n][2 * i + j] = p;
          l[i] += p;
        }
      }
      m[i] = m_new;
    }

    cp_async_wait<0>();
    __syncthreads();

    // O += P V
#pragma unroll
    for (int kt = 0; kt < BN / 16; ++kt) {
      u32 pa[4];
      pa[0] = pack2<DT>(s[2 * kt][0], s[2 * kt][1]);
      pa[1] = pack2<DT>(s[2 * kt][2], s[2 * kt][3]);
      pa[2] = pack2<DT>(s[2 * kt + 1][0], s[2 * kt + 1][1]);
      pa[3] = pack2<DT>(s[2 * kt + 1][2], s[2 * kt + 1][3]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        const int tok = kt * 16 + (lm_mat & 1) * 8 + lm_row;
        const int dim = dp * 16 + (lm_mat >> 1) * 8;
        u32 b0, b1, b2, b3;
        ldmatrix_x4_trans(vs_base + (tok * LDS + dim) * 2, b0, b1, b2, b3);
        mma16816<DT>(o[2 * dp], pa, b0, b1);
        mma16816<DT>(o[2 * dp + 1], pa, b2, b3);
      }
    }
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (pos[i] < 0) continue;
    if (sinks != nullptr) {  // o and l are scaled by 2^-m, the sink's term likewise
      const int head = kvh * group + (row0 + warp * 16 + gid + i * 8) % group;
      l[i] += exp2f(sinks[head] * 1.4426950408889634f - m[i]);  // inf: the output is ~0
    }
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
#pragma unroll
    for (int n = 0; n < NTO; ++n) {
      *(u32*)(out + o_off[i] + n * 8 + tig * 2) =
          pack2<DT>(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
    }
  }
}
