// Shared device helpers for Tandem's CUDA kernels: raw 16-bit float conversions, 16-byte
// loads, cp.async, ldmatrix and mma.sync wrappers. Header-free on purpose: NVRTC compiles
// these sources with no CUDA include path (cuda_bf16.h is not needed anywhere).
// (inlined into each kernel source by ext/cuda/_loader.py)

typedef unsigned short u16;  // raw bf16 or fp16 bits
typedef unsigned int u32;
typedef long long i64;

// DT selects the element type of every 16-bit tensor: 0 = float16, 1 = bfloat16.

struct alignas(16) V16 {
  u32 x, y, z, w;
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ V16 ldg16(const void* p) {
  V16 r;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ void stg16(void* p, const V16& v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// Programmatic dependent launch (sm_90+; no-ops elsewhere and for a kernel launched without
// the attribute): `pdl_wait` blocks until the grids this one depends on have finished and their
// writes are visible; `pdl_trigger` lets the next grid, if launched with the attribute, start.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Two packed 16-bit values -> two floats (lo = element at the lower address).
template <int DT>
__device__ __forceinline__ void unpack2(u32 w, float& lo, float& hi) {
  if constexpr (DT == 1) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
  } else {
    asm("{.reg .f16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;}"
        : "=f"(lo), "=f"(hi)
        : "r"(w));
  }
}

template <int DT>
__device__ __forceinline__ void unpack8(const V16& v, float* f) {
  unpack2<DT>(v.x, f[0], f[1]);
  unpack2<DT>(v.y, f[2], f[3]);
  unpack2<DT>(v.z, f[4], f[5]);
  unpack2<DT>(v.w, f[6], f[7]);
}

// Two floats -> packed 16-bit pair, round to nearest even (lo at the lower address).
template <int DT>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  if constexpr (DT == 1) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

template <int DT>
__device__ __forceinline__ u16 from_float(float f) {
  u16 r;
  if constexpr (DT == 1) {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  } else {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
  }
  return r;
}

// One 16-bit element as float, and a float rounded to the 16-bit type and back.
template <int DT>
__device__ __forceinline__ float ld_f(const u16* p) {
  float lo, hi;
  unpack2<DT>((u32)*p, lo, hi);
  return lo;
}

template <int DT>
__device__ __forceinline__ float round_dt(float v) {
  float lo, hi;
  unpack2<DT>((u32)from_float<DT>(v), lo, hi);
  return lo;
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{.reg .u64 t;\n cvta.to.shared.u64 t, %1;\n cvt.u32.u64 %0, t;}" : "=r"(a) : "l"(p));
  return a;
}

// 16-byte global->shared async copy; when !valid the destination is zero-filled.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
  int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}

// D(16x8 f32) += A(16x16, row) * B(16x8, col), 16-bit inputs.
template <int DT>
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
  if constexpr (DT == 1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// The sequence of query token `tq` (largest s with qsl[s] <= tq) and its context length;
// ctx <= 0 for a row outside every sequence or of an empty (padded) sequence.
__device__ __forceinline__ int token_context(const int* __restrict__ qsl,
                                             const int* __restrict__ seq_lens, int num_seqs,
                                             int tq, int& seq) {
  seq = 0;
  if (num_seqs <= 0 || tq >= qsl[num_seqs]) return 0;
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (qsl[mid] <= tq) lo = mid; else hi = mid - 1;
  }
  seq = lo;
  return seq_lens[lo] - (qsl[lo + 1] - 1 - tq);
}
