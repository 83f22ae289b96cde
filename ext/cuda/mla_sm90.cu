// MLA decode/extend for Hopper (sm_90a): the absorbed-MLA product as two warpgroup GEMMs.
//
// Same contract as mla_attention_kernel (mla_decode.cu), specialised to L = 512, R = 64 and
// 64 heads a CTA (DeepSeek-V3 / Kimi-K2: H = 128, two CTAs per token whose second reads the
// latent rows from L2). Grid (H / 64, tokens from tq0, num_parts); 256 threads = 2 warpgroups.
//   Q [64 heads x 576] stays in shared memory for the whole partition; tiles of 64 latent rows
//   stream through a 2-stage cp.async ring; all three operands live in 128-byte-swizzled
//   "chunks" of [rows x 64 values] so wgmma reads them straight from shared memory.
//   WG0: S = Q K^T (wgmma m64n64k16 x 36; the first QR k-steps of Q held in registers),
//        online softmax in registers (log2 domain), P (bf16/fp16) to shared memory.
//   WG1: issues the next tile's cp.async while WG0 computes S.
//   Both: O[:, 256 wg .. 256 wg + 255] = O * corr + P V (wgmma m64n256k16, V read MN-major).
// Split-KV partials and the combine kernel are shared with mla_decode.cu.
#include "common.cuh"

#include <stdint.h>

#define F8(i)                                                                               \
  "+f"(d[(i) + 0]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), \
      "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])

#define WGMMA_M64N64_ASM(TY) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
  "}, %32, %33, p, 1, 1, 0, %35;\n}\n"

template <int DT, int TB>
__device__ __forceinline__ void wgmma_m64n64(float* d, uint64_t da, uint64_t db, int acc) {
  if constexpr (DT == 1) {
    asm volatile(WGMMA_M64N64_ASM("bf16")
                 : F8(0), F8(8), F8(16), F8(24)
                 : "l"(da), "l"(db), "r"(acc), "n"(TB));
  }
  else {
    asm volatile(WGMMA_M64N64_ASM("f16")
                 : F8(0), F8(8), F8(16), F8(24)
                 : "l"(da), "l"(db), "r"(acc), "n"(TB));
  }
}

#define WGMMA_M64N256_ASM(TY) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
  "}, %128, %129, p, 1, 1, 0, %131;\n}\n"

template <int DT, int TB>
__device__ __forceinline__ void wgmma_m64n256(float* d, uint64_t da, uint64_t db, int acc) {
  if constexpr (DT == 1) {
    asm volatile(WGMMA_M64N256_ASM("bf16")
                 : F8(0), F8(8), F8(16), F8(24), F8(32), F8(40), F8(48), F8(56), F8(64), F8(72), F8(80), F8(88), F8(96), F8(104), F8(112), F8(120)
                 : "l"(da), "l"(db), "r"(acc), "n"(TB));
  }
  else {
    asm volatile(WGMMA_M64N256_ASM("f16")
                 : F8(0), F8(8), F8(16), F8(24), F8(32), F8(40), F8(48), F8(56), F8(64), F8(72), F8(80), F8(88), F8(96), F8(104), F8(112), F8(120)
                 : "l"(da), "l"(db), "r"(acc), "n"(TB));
  }
}
#define WGMMA_M64N64_RS_ASM(TY) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
  "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"

template <int DT, int TB>
__device__ __forceinline__ void wgmma_m64n64_rs(float* d, const u32* a, uint64_t db, int acc) {
  if constexpr (DT == 1) {
    asm volatile(WGMMA_M64N64_RS_ASM("bf16")
                 : F8(0), F8(8), F8(16), F8(24)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB));
  }
  else {
    asm volatile(WGMMA_M64N64_RS_ASM("f16")
                 : F8(0), F8(8), F8(16), F8(24)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB));
  }
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// Generic-proxy shared-memory writes (cp.async, st.shared) made visible to wgmma's async proxy.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void reg_fence(float* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Thread-block cluster: rank, barrier (release/acquire) and a peer CTA's shared memory.
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                   : "memory");
}
__device__ __forceinline__ u32 peer_addr(u32 saddr, u32 rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(saddr), "r"(rank));
  return r;
}
__device__ __forceinline__ float ld_peer(u32 addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float4 ld_peer4(u32 addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// Shared-memory matrix descriptor, 128-byte swizzle (layout type 1), base offset 0: every
// chunk starts on a 1024-byte boundary. Offsets in bytes.
__device__ __forceinline__ uint64_t sw128_desc(u32 saddr, u32 lbo, u32 sbo) {
  return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
         ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// Byte offset of 16-byte unit `u` (0..7) of row `r` inside a [rows x 64 values] chunk.
__device__ __forceinline__ u32 sw128(int r, int u) { return r * 128 + ((u ^ (r & 7)) << 4); }

namespace mla90 {
constexpr int HM = 64;        // heads a CTA
constexpr int BN = 64;        // latent rows a tile
constexpr int L = 512, R = 64, D = L + R;
constexpr int NCH = D / 64;   // swizzle chunks a row (9)
constexpr int CHUNK = BN * 128;       // bytes of one chunk of a tile (= of Q: HM == BN)
constexpr int TILE = NCH * CHUNK;     // 73728
constexpr int Q_OFF = 0;
constexpr int K_OFF = Q_OFF + TILE;
constexpr int P_OFF = K_OFF + 2 * TILE;
constexpr int C_OFF = P_OFF + HM * BN * 2;
constexpr int M_OFF = C_OFF + HM * 4;
constexpr int L_OFF = M_OFF + HM * 4;
constexpr int SMEM = L_OFF + HM * 4 + 1024;  // + slack to align the base to 1024 bytes
constexpr int THREADS = 256;
static_assert(SMEM <= 227 * 1024, "one CTA per SM on sm_90");
}  // namespace mla90

// Tokens [t0, t0 + 64) of the partition into a swizzled tile, by one warpgroup (wtid 0..127);
// rows at or past `end` are zero. Lane l of warp w copies 16-byte unit (l % 8) of each 64-value
// chunk of rows 16 w + 4 p + l / 8 (p < 4): a warp instruction moves four whole 128-byte lines,
// and each thread looks up its four block-table entries once, all loads in flight together.
__device__ __forceinline__ void mla90_load_tile(u32 dst, const u16* __restrict__ cache,
                                                const int* __restrict__ bt, int t0, int end,
                                                int bs_shift, int wtid) {
  using namespace mla90;
  const int bs_mask = (1 << bs_shift) - 1;
  const int u = wtid & 7;
  const u16* src[4];
  bool ok[4];
  int row[4];
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    row[p] = (wtid >> 5) * 16 + p * 4 + ((wtid >> 3) & 3);
    const int t = t0 + row[p];
    ok[p] = t < end;
    src[p] = cache;
    if (ok[p]) src[p] = cache + (((i64)bt[t >> bs_shift] << bs_shift) + (t & bs_mask)) * D + u * 8;
  }
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
#pragma unroll
    for (int p = 0; p < 4; ++p)
      cp_async16(dst + c * CHUNK + sw128(row[p], u), ok[p] ? src[p] + c * 64 : cache, ok[p]);
  }
}

// WG0's score product S = Q K^T of the tile at `kt` (36 wgmma; the first QR k-steps of Q
// from registers); the caller fences, commits and waits.
template <int DT, int QR>
__device__ __forceinline__ void mla90_issue_scores(float* s, const u32 (&qf)[QR > 0 ? QR : 1][4],
                                                   u32 q_base, u32 kt) {
  using namespace mla90;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const u32 off = (ks >> 2) * CHUNK + (ks & 3) * 32;
    const uint64_t kd = sw128_desc(kt + off, 16, 1024);
    if (ks < QR) wgmma_m64n64_rs<DT, 0>(s, qf[QR > 0 ? ks : 0], kd, ks > 0);
    else wgmma_m64n64<DT, 0>(s, sw128_desc(q_base + off, 16, 1024), kd, ks > 0);
  }
}

// Online softmax of a score tile (rows at or past `end` masked): s becomes the exponentials,
// m / l the running max and sum of this thread's rows, c0 / c1 their rescale factors.
// s[4j + e]: row wrow (+8 for e >= 2), column 8j + 2 (lane % 4) + (e & 1).
__device__ __forceinline__ void mla90_softmax(float* s, int t0, int end, float scale_log2,
                                              int lane, float& m0, float& m1, float& l0,
                                              float& l1, float& c0, float& c1) {
  float mx0 = neg_inf(), mx1 = neg_inf();
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = 8 * j + 2 * (lane & 3) + (e & 1);
      const float x = t0 + c < end ? s[4 * j + e] * scale_log2 : neg_inf();
      s[4 * j + e] = x;
      if (e < 2) mx0 = fmaxf(mx0, x); else mx1 = fmaxf(mx1, x);
    }
  }
#pragma unroll
  for (int w = 1; w < 4; w <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, w));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, w));
  }
  const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);  // finite: tile's first row valid
  c0 = exp2f(m0 - n0);
  c1 = exp2f(m1 - n1);
  m0 = n0;
  m1 = n1;
  float p0 = 0.f, p1 = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    s[4 * j] = exp2f(s[4 * j] - n0);
    s[4 * j + 1] = exp2f(s[4 * j + 1] - n0);
    s[4 * j + 2] = exp2f(s[4 * j + 2] - n1);
    s[4 * j + 3] = exp2f(s[4 * j + 3] - n1);
    p0 += s[4 * j] + s[4 * j + 1];
    p1 += s[4 * j + 2] + s[4 * j + 3];
  }
  l0 = l0 * c0 + p0;
  l1 = l1 * c1 + p1;
}

// P (the softmax's exponentials, 16-bit) and the rows' rescale factors into shared memory,
// made visible to wgmma.
template <int DT>
__device__ __forceinline__ void mla90_store_p(const float* s, unsigned char* sP, float* sC,
                                              int wrow, int lane, float c0, float c1) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    *reinterpret_cast<u32*>(sP + sw128(wrow, j) + (lane & 3) * 4) =
        pack2<DT>(s[4 * j], s[4 * j + 1]);
    *reinterpret_cast<u32*>(sP + sw128(wrow + 8, j) + (lane & 3) * 4) =
        pack2<DT>(s[4 * j + 2], s[4 * j + 3]);
  }
  if ((lane & 3) == 0) {
    sC[wrow] = c0;
    sC[wrow + 8] = c1;
  }
  fence_proxy_async();
}

// O = O * corr + P V for this warpgroup's 256 columns; V = the tile's first 512 columns,
// MN-major: 64-column chunks 8 KB apart (LBO), 8-row groups 1 KB apart (SBO); warpgroup wg's
// columns are chunks 4 wg .. 4 wg + 3. The caller commits and waits.
template <int DT>
__device__ __forceinline__ void mla90_rescale_pv(float* o, float c0, float c1, u32 p_base,
                                                 u32 kt, int wg) {
  using namespace mla90;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    o[4 * j] *= c0;
    o[4 * j + 1] *= c0;
    o[4 * j + 2] *= c1;
    o[4 * j + 3] *= c1;
  }
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
    wgmma_m64n256<DT, 1>(o, sw128_desc(p_base + kk * 32, 16, 1024),
                         sw128_desc(kt + wg * 4 * CHUNK + kk * 2048, CHUNK, 1024), 1);
}

// Epilogue: each thread scales its O rows and parks them (float32) in the free tile buffers,
// then the CTA stores whole rows: 8-byte (out) or 16-byte (partials) stores per thread.
// CL > 1: the CL partitions of one (token, 64-head tile) are a cluster; the scale is
// exp2(m - m*) / l* (m*, l*: the cluster's max and sum, from the peers' sM / sL) and CTA r sums
// columns [r L / CL, (r + 1) L / CL) over the peers' parked rows (distributed shared memory)
// into the output: no float32 partials and no combine launch.
template <int DT, int CL>
__device__ __forceinline__ void mla90_epilogue(u16* __restrict__ out, float* __restrict__ part_out,
                                               float* __restrict__ part_lse, const float* o,
                                               u32 base, const float* sM, const float* sL,
                                               int tq, int num_heads, int head0, int wrow,
                                               int tid, bool direct, int pidx, int pcount) {
  using namespace mla90;
  constexpr int OS = L + 4;  // float stride of a parked row (fewer bank conflicts)
  static_assert(HM * OS * 4 <= 2 * TILE, "parked O fits the tile buffers");
  const int wg = tid >> 7, lane = tid & 31;
  u32 rank = 0;
  if constexpr (CL > 1) {
    rank = cluster_rank();
    cluster_sync();  // every peer's m and l are final
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = wrow + 8 * h;
    const float own_l = sL[row];
    float f = own_l > 0.f ? 1.f / own_l : 0.f;
    if constexpr (CL > 1) {
      const u32 sm_off = smem_addr(sM + row), sl_off = smem_addr(sL + row);
      float mp[CL], lp[CL];
      float mx = neg_inf();
#pragma unroll
      for (int r = 0; r < CL; ++r) {
        mp[r] = ld_peer(peer_addr(sm_off, r));
        lp[r] = ld_peer(peer_addr(sl_off, r));
        if (lp[r] > 0.f) mx = fmaxf(mx, mp[r]);
      }
      float lsum = 0.f;
#pragma unroll
      for (int r = 0; r < CL; ++r)
        if (lp[r] > 0.f) lsum += lp[r] * exp2f(mp[r] - mx);
      f = own_l > 0.f ? exp2f(sM[row] - mx) / lsum : 0.f;
    }
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = wg * 256 + 8 * j + 2 * (lane & 3);
      const u32 a = base + K_OFF + (row * OS + col) * 4;
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(a), "f"(o[4 * j + 2 * h] * f),
                   "f"(o[4 * j + 2 * h + 1] * f)
                   : "memory");
    }
  }
  if constexpr (CL > 1) cluster_sync();  // every peer's scaled O is parked
  else __syncthreads();
  constexpr int COLS = L / CL, V4 = COLS / 4;
  for (int i = tid; i < HM * V4; i += THREADS) {
    const int row = i / V4, col = (int)rank * COLS + (i % V4) * 4;
    const u32 a = base + K_OFF + (row * OS + col) * 4;
    float4 acc;
    if constexpr (CL > 1) {
      acc = ld_peer4(peer_addr(a, 0));
#pragma unroll
      for (int r = 1; r < CL; ++r) {
        const float4 v = ld_peer4(peer_addr(a, r));
        acc.x += v.x;
        acc.y += v.y;
        acc.z += v.z;
        acc.w += v.w;
      }
    } else {
      asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                   : "=f"(acc.x), "=f"(acc.y), "=f"(acc.z), "=f"(acc.w)
                   : "r"(a)
                   : "memory");
    }
    const i64 orow = (i64)tq * num_heads + head0 + row;
    if (direct) {
      *reinterpret_cast<uint2*>(out + orow * L + col) =
          make_uint2(pack2<DT>(acc.x, acc.y), pack2<DT>(acc.z, acc.w));
    } else {
      *reinterpret_cast<float4*>(part_out + (orow * pcount + pidx) * L + col) = acc;
    }
  }
  if (!direct && tid < HM) {  // CL == 1: this partition's log2-sum-exp
    const float l = sL[tid];
    part_lse[((i64)tq * num_heads + head0 + tid) * pcount + pidx] =
        l > 0.f ? sM[tid] + log2f(l) : neg_inf();
  }
  if constexpr (CL > 1) cluster_sync();  // no CTA leaves while a peer reads its shared memory
}

// CL: cluster size along the partitions (grid z == num_parts == CL); CL > 1 merges the
// partitions' outputs through distributed shared memory instead of float32 partials and the
// combine kernel.
template <int DT, int QR, int CL>
__device__ __forceinline__ void mla90_body(
    u16* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_lse,
    const u16* __restrict__ q_lat, const u16* __restrict__ q_rope,
    const u16* __restrict__ cache, const int* __restrict__ qsl,
    const int* __restrict__ seq_lens, const int* __restrict__ block_tables, int tq0,
    int num_seqs, int num_heads, i64 ql_t, i64 ql_h, i64 qr_t, i64 qr_h, int bt_stride,
    int bs_shift, int part_len, int num_parts, float scale_log2) {
  using namespace mla90;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 raw = smem_addr(smem_raw);
  const u32 base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  float* sC = reinterpret_cast<float*>(smem + C_OFF);
  float* sM = reinterpret_cast<float*>(smem + M_OFF);
  float* sL = reinterpret_cast<float*>(smem + L_OFF);

  const int tid = threadIdx.x;
  const int wg = tid >> 7;        // warpgroup
  const int wtid = tid & 127;
  const int lane = tid & 31;
  const int wrow = (wtid >> 5) * 16 + (lane >> 2);  // this thread's rows: wrow, wrow + 8
  const int head0 = blockIdx.x * HM;
  const int tq = tq0 + blockIdx.y;
  const int part = blockIdx.z;

  int seq;
  const int ctx = token_context(qsl, seq_lens, num_seqs, tq, seq);
  if (ctx <= 0) {  // padded row: defined output
    if (part == 0) {
      for (int i = tid; i < HM * L / 8; i += THREADS) {
        const int row = i / (L / 8), c8 = i % (L / 8);
        stg16(out + ((i64)tq * num_heads + head0 + row) * L + c8 * 8, V16{0, 0, 0, 0});
      }
    }
    return;
  }
  const int start = part * part_len;
  if (CL == 1 && start >= ctx) return;  // a cluster's empty partition still joins the merge
  const int end = min(ctx, start + part_len);
  const int token_parts = (ctx + part_len - 1) / part_len;
  const int ntiles = end > start ? (end - start + BN - 1) / BN : 0;
  const int* bt = block_tables + (i64)seq * bt_stride;

  // Q [64 heads x (L | R)] into 9 swizzled chunks, by all threads; tile 0 by WG1.
  for (int i = tid; i < HM * (D / 8); i += THREADS) {
    const int r = i / (D / 8), u = i % (D / 8);
    const u16* src = u < L / 8
        ? q_lat + (i64)tq * ql_t + (i64)(head0 + r) * ql_h + u * 8
        : q_rope + (i64)tq * qr_t + (i64)(head0 + r) * qr_h + (u - L / 8) * 8;
    cp_async16(base + Q_OFF + (u >> 3) * CHUNK + sw128(r, u & 7), src, true);
  }
  if (wg == 1) mla90_load_tile(base + K_OFF, cache, bt, start, end, bs_shift, wtid);
  cp_async_commit();

  // WG0 keeps the first QR k-steps of its Q fragments in registers (less shared-memory
  // traffic in the score product, which also competes with the tile loads).
  u32 qf[QR > 0 ? QR : 1][4];
  if constexpr (QR > 0) {
    cp_async_wait<0>();
    __syncthreads();
    if (wg == 0) {
      const int r = (wtid >> 5) * 16 + (lane & 15);
#pragma unroll
      for (int ks = 0; ks < QR; ++ks)
        ldmatrix_x4(base + Q_OFF + (ks >> 2) * CHUNK + sw128(r, (ks & 3) * 2 + (lane >> 4)),
                    qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3]);
    }
  }
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m0 = neg_inf(), m1 = neg_inf();  // running max of rows wrow, wrow + 8 (WG0)
  float l0 = 0.f, l1 = 0.f;              // this thread's share of their sums (WG0)

  const u32 p_base = base + P_OFF;
  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // tile `it` landed; every PV of tile it - 1 is done
    const u32 kt = base + K_OFF + (it & 1) * TILE;
    const int t0 = start + it * BN;
    float c0, c1;
    if (wg == 1) {
      if (it + 1 < ntiles)
        mla90_load_tile(base + K_OFF + ((it + 1) & 1) * TILE, cache, bt, t0 + BN, end,
                        bs_shift, wtid);
      cp_async_commit();
    } else {
      float s[32];
      wgmma_fence();
      mla90_issue_scores<DT, QR>(s, qf, base + Q_OFF, kt);
      wgmma_commit();
      wgmma_wait0();
      reg_fence<32>(s);
      mla90_softmax(s, t0, end, scale_log2, lane, m0, m1, l0, l1, c0, c1);
      mla90_store_p<DT>(s, smem + P_OFF, sC, wrow, lane, c0, c1);
    }
    __syncthreads();  // P and corr of tile `it` are in shared memory
    if (wg == 1) {
      c0 = sC[wrow];
      c1 = sC[wrow + 8];
    }
    mla90_rescale_pv<DT>(o, c0, c1, p_base, kt, wg);
    wgmma_commit();
    wgmma_wait0();
    reg_fence<128>(o);
  }
  cp_async_wait<0>();
  if (wg == 0) {
#pragma unroll
    for (int w = 1; w < 4; w <<= 1) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, w);
      l1 += __shfl_xor_sync(0xffffffffu, l1, w);
    }
    if ((lane & 3) == 0) {
      sM[wrow] = m0;
      sM[wrow + 8] = m1;
      sL[wrow] = l0;
      sL[wrow + 8] = l1;
    }
  }
  __syncthreads();

  mla90_epilogue<DT, CL>(out, part_out, part_lse, o, base, sM, sL, tq, num_heads, head0, wrow,
                         tid, CL > 1 || token_parts == 1, part, num_parts);
}

#define MLA90_KERNEL(NAME, DT, QR, CL, ATTR)                                                 \
  extern "C" __global__ void __launch_bounds__(256, 1) ATTR NAME(                              \
      u16* out, float* part_out, float* part_lse, const u16* q_lat, const u16* q_rope,         \
      const u16* cache, const int* qsl, const int* seq_lens, const int* block_tables, int tq0, \
      int num_seqs, int num_heads, i64 ql_t, i64 ql_h, i64 qr_t, i64 qr_h, int bt_stride,      \
      int bs_shift, int part_len, int num_parts, float scale_log2) {                           \
    mla90_body<DT, QR, CL>(out, part_out, part_lse, q_lat, q_rope, cache, qsl, seq_lens,   \
                               block_tables, tq0, num_seqs, num_heads, ql_t, ql_h, qr_t, qr_h, \
                               bt_stride, bs_shift, part_len, num_parts, scale_log2);          \
  }
#define MLA90_NOCLUSTER
#define MLA90_CLUSTER(CL) __cluster_dims__(1, 1, CL)

#ifndef MLA90_NO_KERNELS
// QR = 8: measured against 0, 4, 12 and 16 (and the variants docs/mla.md lists as not helping).
MLA90_KERNEL(mla90_f16, 0, 8, 1, MLA90_NOCLUSTER)
MLA90_KERNEL(mla90_bf16, 1, 8, 1, MLA90_NOCLUSTER)
MLA90_KERNEL(mla90_c2_f16, 0, 8, 2, MLA90_CLUSTER(2))
MLA90_KERNEL(mla90_c2_bf16, 1, 8, 2, MLA90_CLUSTER(2))
#endif
