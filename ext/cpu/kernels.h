// Weight layout and the per-ISA kernel interface of the CPU expert pool.
//
// Every ISA lives in its own translation unit compiled with its own -m flags. This header is
// included by all of them, so everything defined here is `static inline` (internal linkage):
// an inline function with external linkage could be emitted by the AVX-512 unit and picked by
// the linker for the baseline code, which would then fault on an older CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace tandem_cpu {

enum Fmt : int { FMT_BF16 = 0, FMT_INT8 = 1, FMT_INT4 = 2 };

// Converted weights are kept as rows of K elements; K is always a multiple of kKAlign.
// int8: one fp32 scale per row, value = q * scale.
// int4: one fp32 scale per group of `group` elements along K, value = (nibble - 8) * scale.
//       Each 64-element chunk is 32 bytes: byte j holds element j (low nibble) and j+32 (high),
//       so one widening load and a mask or a shift give 32 consecutive elements.
constexpr int kKAlign = 64;
constexpr int kRowBlock = 64;   // weight rows per work item (gate/up: 32 gate + 32 up rows)
// Tokens of one expert from which the AMX bf16 path is used (below: the AVX-512 kernel; env
// TANDEM_AMX_BF16_MIN_TOKENS overrides). 1: on the device's Xeon the tiles stream a layer's
// weights 5-26% faster than the AVX-512 kernel at every token count from 1 (BENCHMARKS, session 12).
constexpr int kAmxMinTokens = 1;
// Tokens of one expert from which the AMX int8 path multiplies in tiles (below: VNNI; env
// TANDEM_AMX_TILE_MIN_TOKENS overrides): on the device's Xeon the tiles win from 6-8 tokens an
// expert (8 experts of the Qwen3-30B-A3B shape, top-8; BENCHMARKS, session 9), VNNI below.
// For int4 weights in groups of 32 the tiles quantize activations per 32-element block as VNNI
// does, so the choice is speed only; in groups of kTileQBlock4 per block of that size (one
// block a weight group: a tile product needs one store and one rescale, not two). For packed
// int8 rows they take 16-bit activations with one scale per token (kRow16Levels): 60x more
// accurate than the blocks on SmolLM2's activations (tools/act_quant_error.py) and free of
// per-block rescaling. Such an expert's output then changes across this threshold by the
// difference of the two quantizations' errors.
constexpr int kAmxTileMinTokens = 8;
constexpr int kTileQBlock4 = 64;
// The tiles' int8-weight activations: scale = absmax of the token's row / kRow16Levels, q =
// round-half-even(x / scale) in [-kRow16Levels, kRow16Levels], as hi * 256 + lo with hi, lo in
// [-127, 127] / [-128, 127] (ext/cpu/reference.py: quantize_activations(levels=kRow16Levels)).
constexpr int kRow16Levels = 32639;

struct WeightView {
  int fmt;
  const uint8_t* data;  // row r at data + r * row_bytes
  size_t row_bytes;
  const float* scales;  // int8: [rows]; int4: [rows][K / group]; bf16: unused
  int group;            // int4 group size
  bool packed = false;  // int8/int4 rows in the packed order (below: packed_at)
};

// Activations of one expert, prepared once per phase in the layout the ISA wants.
//   prep_bytes(K, n): bytes needed for n tokens.
//   prep(x, Kv, K, n, dst): x[t] holds Kv <= K floats; elements past Kv are taken as zero.
//   gemm(w, R, K, xp, n, C, ldc, scratch): C[t * ldc + r] = sum_k W[r, k] * x_t[k]
//     for r < R (a multiple of 32), t < n; scratch holds gemm_scratch_bytes(R, K) bytes.
//   scratch_bytes(R, K): gemm's scratch; null: gemm_scratch_bytes.
struct KernelSet {
  const char* name;
  size_t (*prep_bytes)(int K, int n);
  void (*prep)(const float* const* x, int Kv, int K, int n, void* dst);
  void (*gemm)(const WeightView& w, int R, int K, const void* xp, int n, float* C, int ldc,
               uint8_t* scratch);
  size_t (*scratch_bytes)(int R, int K) = nullptr;
  // dst[i] = silu(gate[i]) * up[i] for i < n; null: the caller's scalar loop.
  void (*silu_mul)(const float* gate, const float* up, float* dst, int n) = nullptr;
  // gemm takes packed int rows (WeightView.packed) as they are; false: the caller hands it
  // natural rows (unpacked per work item).
  bool reads_packed = false;
  // Tokens of one expert from which gemm multiplies in AMX tiles (kernels_amx_int8); 0: none.
  int tiles_from = 0;
};

static inline size_t gemm_scratch_bytes(int R, int K) {
  return (size_t)R * K * 2 + (size_t)K * 4 + 8192;
}

static inline size_t kernel_scratch_bytes(const KernelSet& ks, int R, int K) {
  return ks.scratch_bytes ? ks.scratch_bytes(R, K) : gemm_scratch_bytes(R, K);
}

// The integer path for int8/int4 weights (kernels_vnni.cpp, kernels_amx_int8.cpp): the
// quantized weights are multiplied as integers, never widened to floats. Activations are
// quantized per token and per block of kQBlock elements: scale = absmax / 127 (fp32),
// q = round-half-even(x / scale) in [-127, 127] (ext/cpu/reference.py: quantize_activations).
// Products of one block are summed in int32, then scaled by the activation block's scale and
// the weight's (int4 group / int8 row) scale in fp32. Its KernelSet only takes int8/int4
// weights; the pool uses it for experts with at least int_min_tokens tokens.
constexpr int kQBlock = 32;
constexpr int kQSuper = 16 * kQBlock;  // VNNI: one int32 lane per block, 16 blocks a vector
static inline int qsuper_pad(int K) { return (K + kQSuper - 1) / kQSuper * kQSuper; }

static inline size_t row_bytes(int fmt, int K) {
  return fmt == FMT_BF16 ? (size_t)K * 2 : fmt == FMT_INT8 ? (size_t)K : (size_t)K / 2;
}

static inline int scales_per_row(int fmt, int K, int group) {
  return fmt == FMT_BF16 ? 0 : fmt == FMT_INT8 ? 1 : K / group;
}

// Packed int rows (Layer::packed, on CPUs with the integer path): each row's elements are
// stored in the order the VNNI kernel multiplies them, so it reads them with plain loads instead
// of transposing every row on every call. A row is cut into super-blocks of kQSuper elements
// (the last one holds m = the rest / kQBlock blocks, m even); in a super-block with m blocks:
//   int8: 8 runs j of 4m bytes; run j holds at bytes [4 l, 4 l + 4) the elements
//         [32 l + 4 j, 32 l + 4 j + 4) of block l (kQSuper bytes a full super-block);
//   int4: 4 runs u of 4m bytes; byte 4 l + b holds element 32 l + 4 u + b in its low nibble and
//         element 32 l + 16 + 4 u + b in its high one (kQSuper / 2 bytes a full super-block).
// Scales keep their natural order. A row is a permutation of the natural row's bytes (int8) or
// nibbles (int4): same size, and packing is per row, so row slices of a layer stay valid.
static inline int packed_blocks(int K, int sb) {
  const int rest = (K - sb * kQSuper) / kQBlock;
  return rest < 16 ? rest : 16;
}

// The 4-byte word of a packed row of K elements holding natural elements [k, k + 4) (k % 4 ==
// 0): int8 as its 4 bytes, int4 in the low (k % 32 < 16) or high nibbles of its 4 bytes.
static inline size_t packed_word(int fmt, int K, int k) {
  const int sb = k / kQSuper, m = packed_blocks(K, sb), l = (k % kQSuper) / kQBlock, i = k % kQBlock;
  const int run = fmt == FMT_INT8 ? i / 4 : (i % 16) / 4;
  const int sb_words = fmt == FMT_INT8 ? kQSuper / 4 : kQSuper / 8;  // of a full super-block
  return (size_t)sb * sb_words + (size_t)run * m + l;
}

// Byte of natural element k in a packed row of K elements; *high: int4 high nibble.
static inline size_t packed_at(int fmt, int K, int k, bool* high) {
  *high = fmt == FMT_INT4 && k % kQBlock >= 16;
  return 4 * packed_word(fmt, K, k & ~3) + k % 4;
}

// Byte of natural element k in a natural int4 row (kernels.h: 64-element chunks of 32 bytes).
static inline size_t natural_int4_at(int k, bool* high) {
  *high = (k % 64) >= 32;
  return (size_t)(k / 64) * 32 + k % 32;
}

// One int8/int4 row of K elements, natural -> packed (pack) or packed -> natural. Portable and
// byte by byte: conversion, save/load and tests; the kernels use vnni_unpack_rows.
static inline void repack_row(int fmt, int K, const uint8_t* src, uint8_t* dst, bool pack) {
  if (fmt == FMT_INT8) {
    for (int k = 0; k < K; ++k) {
      bool h;
      const size_t p = packed_at(fmt, K, k, &h);
      if (pack) dst[p] = src[k];
      else dst[k] = src[p];
    }
    return;
  }
  std::memset(dst, 0, (size_t)K / 2);
  for (int k = 0; k < K; ++k) {
    bool hp, hn;
    const size_t p = packed_at(fmt, K, k, &hp), n = natural_int4_at(k, &hn);
    const size_t from = pack ? n : p, to = pack ? p : n;
    const bool from_high = pack ? hn : hp, to_high = pack ? hp : hn;
    const uint8_t v = from_high ? src[from] >> 4 : src[from] & 15;
    dst[to] |= to_high ? (uint8_t)(v << 4) : v;
  }
}

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as _mm512_cvtneps_pbh and torch's .to(torch.bfloat16) do.
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// Row r of w as floats (int8 scale included).
static inline void dequant_row(const WeightView& w, int r, int K, float* dst) {
  const uint8_t* row = w.data + (size_t)r * w.row_bytes;
  if (w.fmt == FMT_BF16) {
    const uint16_t* p = (const uint16_t*)row;
    for (int k = 0; k < K; ++k) dst[k] = bf16_to_f32(p[k]);
  } else if (w.packed) {  // int8/int4 in the packed order: element by element
    const float* s = w.scales + (size_t)r * (w.fmt == FMT_INT8 ? 1 : K / w.group);
    for (int k = 0; k < K; ++k) {
      bool high;
      const uint8_t b = row[packed_at(w.fmt, K, k, &high)];
      dst[k] = w.fmt == FMT_INT8 ? (float)(int8_t)b * s[0]
                                 : (float)((int)(high ? b >> 4 : b & 15) - 8) * s[k / w.group];
    }
  } else if (w.fmt == FMT_INT8) {
    const int8_t* p = (const int8_t*)row;
    const float s = w.scales[r];
    for (int k = 0; k < K; ++k) dst[k] = (float)p[k] * s;
  } else {
    const int groups = K / w.group;
    const float* s = w.scales + (size_t)r * groups;
    for (int c = 0; c < K / 64; ++c) {
      const uint8_t* b = row + c * 32;
      for (int j = 0; j < 32; ++j) {
        const int k0 = c * 64 + j, k1 = k0 + 32;
        dst[k0] = (float)((int)(b[j] & 15) - 8) * s[k0 / w.group];
        dst[k1] = (float)((int)(b[j] >> 4) - 8) * s[k1 / w.group];
      }
    }
  }
}

KernelSet kernels_scalar();
#ifdef TANDEM_HAVE_AVX2
KernelSet kernels_avx2();
#endif
#ifdef TANDEM_HAVE_AVX512
KernelSet kernels_avx512();
// Rows [0, R) of w as bf16 into dst[R][K]; int8 rows are left unscaled (exact), int4 scaled.
void avx512_dequant_bf16(const WeightView& w, int R, int K, uint16_t* dst);
void avx512_gemm(const WeightView& w, int R, int K, const void* xp, int n, float* C, int ldc,
                 uint8_t* scratch);
// silu(gate) * up, 16 lanes at a time (exp by range reduction and a degree-6 polynomial,
// within 4e-6 of std::exp over the float range, 1e-6 for SiLU: measured).
void avx512_silu_mul(const float* gate, const float* up, float* dst, int n);
#endif
#ifdef TANDEM_HAVE_AMX
KernelSet kernels_amx();
#endif
// Tokens per expert from which the integer path beats widening the weights (measured): on the
// device's Xeon (AMX), one layer of the Qwen3-30B-A3B shape at 1 token took 0.254 ms (int4) /
// 0.517 ms (int8) on the integer path against 0.462 / 0.698 ms widened. With packed rows
// (packed_at) the VNNI kernel no longer transposes weights per call: on a 2-core AVX-512 VNNI
// VM one such layer at 1 token took 1.41 ms (int4) / 2.27 ms (int8) against 2.67 / 4.03 ms
// widened from natural rows, so both take it from 1 token.
constexpr int kVnniMinTokens = 1;
constexpr int kAmxIntMinTokens = 1;
#ifdef TANDEM_HAVE_VNNI
KernelSet kernels_vnni();
size_t vnni_prep_bytes(int K, int n);
void vnni_prep(const float* const* x, int Kv, int K, int n, void* dst);
void vnni_gemm(const WeightView& w, int R, int K, const void* xp, int n, float* C, int ldc,
               uint8_t* scratch);
size_t vnni_scratch_bytes(int R, int K);
// Packed rows [0, R) of w (int8/int4) in the natural order: dst[R][row_bytes(fmt, K)].
void vnni_unpack_rows(const WeightView& w, int R, int K, uint8_t* dst);
// Packed int4 rows [0, R) as s8 (nibble - 8) in the natural order: dst[R][K].
void vnni_unpack_int4_s8(const WeightView& w, int R, int K, int8_t* dst);
#endif
#ifdef TANDEM_HAVE_AMX_INT8
// tdpbssd from kAmxTileMinTokens tokens, VNNI below; fmt: the weights' (FMT_INT8 or FMT_INT4),
// group: int4's group size (kTileQBlock4: activations in blocks of 64 on the tiles).
KernelSet kernels_amx_int8(int fmt, int group = 0);
#endif

}  // namespace tandem_cpu
