// Decode attention over a paged KV cache: one query token per sequence.
//
// Grid (num_kv_heads * head_chunks, num_seqs, num_parts), 128 threads. One CTA streams one
// split-K partition of one sequence's context for GP query heads that share a KV head, so each
// K/V row is read from memory once per KV-head group. Inside the CTA, D/8 threads own one token
// (16 bytes of its K and V row each); the 128/(D/8) token groups stream tokens independently,
// each with its own online softmax, and merge through shared memory at the end.
// A sequence that fits in one partition writes `out` directly; otherwise each partition writes
// its normalised partial output and log2-sum-exp, merged by paged_decode_reduce_kernel.
// A sliding-window layer (`window` > 0) splits only its last `window` tokens into partitions:
// blocks before them are never read. Learned per-head sinks (`sinks`, natural-log logits, may
// be null) join each head's softmax denominator once, where the partitions are merged.
#include "common.cuh"

template <int DT, int D, int GP>
__global__ void __launch_bounds__(128) paged_decode_kernel(
    u16* __restrict__ out,             // [S, H, D]
    float* __restrict__ part_out,      // [S, H, NP, D] (only when num_parts > 1)
    float* __restrict__ part_lse,      // [S, H, NP]
    const u16* __restrict__ q,         // [S, H, D] with strides (q_stride_s, q_stride_h, 1)
    const u16* __restrict__ k_cache,   // [NB, BS, HKV, D]
    const u16* __restrict__ v_cache,   // [NB, BS, HKV, D]
    const int* __restrict__ seq_lens,  // [S]
    const int* __restrict__ block_tables,  // [S, bt_stride]
    const float* __restrict__ sinks,   // [H] or null
    int num_heads, int num_kv_heads, int group, int q_stride_s, int q_stride_h, int bt_stride,
    int bs_shift, int part_len, int num_parts, int window, float scale_log2) {
  constexpr int NT = 128;
  constexpr int TPT = D / 8;     // threads per token
  constexpr int NG = NT / TPT;   // token groups per CTA
  constexpr int U = GP >= 8 ? 2 : 4;  // tokens in flight per group
  pdl_wait();  // launched with programmatic dependent launch
  pdl_trigger();

  const int tid = threadIdx.x;
  const int grp = tid / TPT;
  const int lig = tid % TPT;
  const int chunks = (group + GP - 1) / GP;
  const int kvh = blockIdx.x / chunks;
  const int chunk = blockIdx.x % chunks;
  const int seq = blockIdx.y;
  const int part = blockIdx.z;
  const int head0 = kvh * group + chunk * GP;
  const int nvalid = min(GP, group - chunk * GP);

  const int seq_len = seq_lens[seq];
  if (seq_len <= 0) {  // padded batch entry: defined output, no NaN
    if (part == 0 && tid < D) {
      for (int g = 0; g < nvalid; ++g) out[((i64)seq * num_heads + head0 + g) * D + tid] = 0;
    }
    return;
  }
  const int lo = window > 0 ? max(0, seq_len - window) : 0;  // first token the query sees
  const int start = lo + part * part_len;
  if (start >= seq_len) return;
  const int end = min(seq_len, start + part_len);
  const int seq_parts = (seq_len - lo + part_len - 1) / part_len;

  float qf[GP][8];
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    if (g < nvalid) {
      V16 raw = ldg16(q + (i64)seq * q_stride_s + (i64)(head0 + g) * q_stride_h + lig * 8);
      unpack8<DT>(raw, qf[g]);
#pragma unroll
      for (int e = 0; e < 8; ++e) qf[g][e] *= scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) qf[g][e] = 0.f;
    }
  }

  float m[GP], l[GP], acc[GP][8];
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    m[g] = neg_inf();
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }

  const i64 slot_stride = (i64)num_kv_heads * D;
  const i64 head_off = (i64)kvh * D + lig * 8;
  const int* bt = block_tables + (i64)seq * bt_stride;
  const int bs_mask = (1 << bs_shift) - 1;

  // Uniform trip count across the CTA (shuffles need every lane of a warp).
  for (int base = start; base < end; base += NG * U) {
    V16 kr[U], vr[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = base + u * NG + grp;
      ok[u] = t < end;
      if (ok[u]) {
        const i64 slot = ((i64)bt[t >> bs_shift] << bs_shift) + (t & bs_mask);
        const i64 off = slot * slot_stride + head_off;
        kr[u] = ldg16(k_cache + off);
        vr[u] = ldg16(v_cache + off);
      } else {
        kr[u] = V16{0, 0, 0, 0};
        vr[u] = V16{0, 0, 0, 0};
      }
    }
    float s[U][GP];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8];
      unpack8<DT>(kr[u], kf);
#pragma unroll
      for (int g = 0; g < GP; ++g) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) d = fmaf(qf[g][e], kf[e], d);
        s[u][g] = d;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int g = 0; g < GP; ++g) {
#pragma unroll
        for (int o = TPT / 2; o > 0; o >>= 1) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], o);
        if (!ok[u]) s[u][g] = neg_inf();
      }
    }
    float vf[U][8];
#pragma unroll
    for (int u = 0; u < U; ++u) unpack8<DT>(vr[u], vf[u]);
#pragma unroll
    for (int g = 0; g < GP; ++g) {
      float mx = s[0][g];
#pragma unroll
      for (int u = 1; u < U; ++u) mx = fmaxf(mx, s[u][g]);
      const float m_new = fmaxf(m[g], mx);
      if (m_new == neg_inf()) continue;  // nothing seen yet by this group
      const float corr = exp2f(m[g] - m_new);
      l[g] *= corr;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= corr;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = exp2f(s[u][g] - m_new);
        l[g] += p;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, vf[u][e], acc[g][e]);
      }
      m[g] = m_new;
    }
  }

  // Merge the NG token groups, one head at a time.
  __shared__ float sm_m[NG][GP];
  __shared__ float sm_l[NG][GP];
  __shared__ float sm_acc[NG][D];
  if (lig == 0) {
#pragma unroll
    for (int g = 0; g < GP; ++g) {
      sm_m[grp][g] = m[g];
      sm_l[grp][g] = l[g];
    }
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    float M = neg_inf();
#pragma unroll
    for (int i = 0; i < NG; ++i) M = fmaxf(M, sm_m[i][g]);
    float L = 0.f;
#pragma unroll
    for (int i = 0; i < NG; ++i) {
      const float mi = sm_m[i][g];
      if (mi != neg_inf()) L += sm_l[i][g] * exp2f(mi - M);
    }
    if (sinks != nullptr && seq_parts == 1 && g < nvalid) {  // the sink's term, once per head
      const float sk = sinks[head0 + g] * 1.4426950408889634f;
      const float M2 = fmaxf(M, sk);
      L = L * exp2f(M - M2) + exp2f(sk - M2);
      M = M2;
    }
    const float f = (m[g] == neg_inf()) ? 0.f : exp2f(m[g] - M);
#pragma unroll
    for (int e = 0; e < 8; ++e) sm_acc[grp][lig * 8 + e] = acc[g][e] * f;
    __syncthreads();
    if (tid < D && g < nvalid) {
      float o = 0.f;
#pragma unroll
      for (int i = 0; i < NG; ++i) o += sm_acc[i][tid];
      const float inv = L > 0.f ? 1.f / L : 0.f;
      const int head = head0 + g;
      if (seq_parts == 1) {
        out[((i64)seq * num_heads + head) * D + tid] = from_float<DT>(o * inv);
      } else {
        const i64 row = ((i64)seq * num_heads + head) * num_parts + part;
        part_out[row * D + tid] = o * inv;
        if (tid == 0) part_lse[row] = L > 0.f ? M + log2f(L) : neg_inf();
      }
    }
    __syncthreads();
  }
}

// Merge split-K partitions: out = sum_p w_p * o_p / sum_p w_p, w_p = 2^(lse_p - max lse).
// Grid (num_heads, num_seqs), D threads. Sequences with a single partition were written
// directly by the partition kernel and are skipped.
template <int DT, int D>
__global__ void __launch_bounds__(D) paged_decode_reduce_kernel(
    u16* __restrict__ out, const float* __restrict__ part_out, const float* __restrict__ part_lse,
    const int* __restrict__ seq_lens, const float* __restrict__ sinks, int num_heads,
    int part_len, int num_parts, int window) {
  pdl_wait();
  pdl_trigger();
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int seq_len = seq_lens[seq];
  const int len = window > 0 ? min(seq_len, window) : seq_len;
  const int np = seq_len > 0 ? (len + part_len - 1) / part_len : 0;
  if (np <= 1) return;
  const i64 row = ((i64)seq * num_heads + head) * num_parts;
  const float* lse = part_lse + row;
  float M = neg_inf();
  for (int p = 0; p < np; ++p) M = fmaxf(M, lse[p]);
  float wsum = 0.f, o = 0.f;
  if (sinks != nullptr) {  // the sink's logit joins the denominator only
    const float sk = sinks[head] * 1.4426950408889634f;
    M = fmaxf(M, sk);
    wsum = exp2f(sk - M);
  }
  for (int p = 0; p < np; ++p) {
    const float lp = lse[p];
    if (lp == neg_inf()) continue;
    const float w = exp2f(lp - M);
    wsum += w;
    o = fmaf(w, part_out[(row + p) * D + threadIdx.x], o);
  }
  out[((i64)seq * num_heads + head) * D + threadIdx.x] = from_float<DT>(wsum > 0.f ? o / wsum : 0.f);
}
