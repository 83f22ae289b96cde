// Converting a layer's source weights (fp32/bf16/f16) into the pool's formats (bf16, int8,
// int4; natural or packed rows) on each node's own workers, and back to fp32 (dequantize).
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "moe.h"
#include "moe_internal.h"

namespace tandem_cpu {
namespace moe_impl {
namespace {

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// round(v) to the nearest integer, ties to even, as std::nearbyint in the default rounding mode
// (and torch.round), without the library call: exact for |v| < 2^22 (here |v| <= 127 and a
// rounding error). Relies on strict IEEE float arithmetic: the extension is built without
// -ffast-math (ext/cpu/build.py), which would fold the two additions away.
inline float round_even(float v) {
  constexpr float kMagic = 12582912.f;  // 1.5 * 2^23
  return (v + kMagic) - kMagic;
}

// Where quantize_row writes element k of a packed row (pack_rows): the byte for int8, for int4
// (byte << 1 | high nibble). One table per (format, K) and thread, built on first use.
const uint32_t* pack_map(int fmt, int K) {
  thread_local int map_fmt = -1, map_k = -1;
  thread_local std::vector<uint32_t> map;
  if (map_fmt != fmt || map_k != K) {
    map.resize(K);
    for (int k = 0; k < K; ++k) {
      bool high;
      const size_t at = packed_at(fmt, K, k, &high);
      map[k] = fmt == FMT_INT8 ? (uint32_t)at : (uint32_t)(at << 1 | (high ? 1 : 0));
    }
    map_fmt = fmt;
    map_k = K;
  }
  return map.data();
}

// One row of K floats into the converted layout. Matches ext/cpu/reference.py::quantize.
// int8: amax is the row's absolute maximum over all its columns (not only this shard's), so the
// result does not depend on how many NUMA nodes share the row; negative means "compute it".
// `map` (int8/int4, from pack_map): the row in the packed order instead of the natural one.
void quantize_row(int fmt, int group, const float* x, int K, uint8_t* dst, float* scales,
                  float amax = -1.f, const uint32_t* map = nullptr) {
  if (fmt == FMT_BF16) {
    uint16_t* d = (uint16_t*)dst;
    for (int k = 0; k < K; ++k) d[k] = f32_to_bf16(x[k]);
  } else if (fmt == FMT_INT8) {
    if (amax < 0.f) {
      amax = 0.f;
      for (int k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
    }
    const float s = amax / 127.f;
    scales[0] = s;
    int8_t* d = (int8_t*)dst;
    for (int k = 0; k < K; ++k)
      d[map ? map[k] : k] =
          s > 0.f ? (int8_t)std::min(127.f, std::max(-127.f, round_even(x[k] / s))) : 0;
  } else {
    // 16 levels, as GGUF's Q4_0: the element of largest magnitude (the first on ties) maps to
    // -8 exactly, so s = that element / -8 may be negative; q = round(x / s) in [-8, 7].
    std::memset(dst, 0, (size_t)K / 2);
    for (int g = 0; g < K / group; ++g) {
      float amax = 0.f, peak = 0.f;
      for (int k = g * group; k < (g + 1) * group; ++k)
        if (std::fabs(x[k]) > amax) {
          amax = std::fabs(x[k]);
          peak = x[k];
        }
      const float s = peak / -8.f;
      scales[g] = s;
      for (int k = g * group; k < (g + 1) * group; ++k) {
        const float q = s != 0.f ? std::min(7.f, std::max(-8.f, round_even(x[k] / s))) : 0.f;
        const uint8_t nib = (uint8_t)((int)q + 8);
        bool high = map && (map[k] & 1);
        const size_t at = map ? map[k] >> 1 : natural_int4_at(k, &high);
        dst[at] |= high ? (uint8_t)(nib << 4) : nib;
      }
    }
  }
}

}  // namespace

// count elements of a source tensor from element offset `at`, as floats.
void load_src(const void* base, int dtype, size_t at, int count, float* dst) {
  if (dtype == SRC_F32) {
    std::memcpy(dst, (const float*)base + at, sizeof(float) * count);
  } else if (dtype == SRC_BF16) {
    const uint16_t* p = (const uint16_t*)base + at;
    for (int i = 0; i < count; ++i) dst[i] = bf16_to_f32(p[i]);
  } else {
    const uint16_t* p = (const uint16_t*)base + at;
    for (int i = 0; i < count; ++i) dst[i] = f16_to_f32(p[i]);
  }
}

void convert_row(int fmt, int group, bool packed, const float* x, int K, uint8_t* dst,
                 float* scales, float amax) {
  const bool pack = packed && fmt != FMT_BF16;
  quantize_row(fmt, group, x, K, dst, scales, amax, pack ? pack_map(fmt, K) : nullptr);
}

void unpack_rows_portable(const WeightView& w, int R, int K, uint8_t* dst) {
  const size_t rb = row_bytes(w.fmt, K);
  for (int r = 0; r < R; ++r)
    repack_row(w.fmt, K, w.data + (size_t)r * w.row_bytes, dst + (size_t)r * rb, /*pack=*/false);
}

Shard plan_shard(const Layer& L, int i0, int Is) {
  const int fmt = L.fmt, group = L.group, Hp = L.Hp;
  Shard s;
  s.i0 = i0;
  s.Is = Is;
  s.Iv = std::max(0, std::min(Is, L.I - i0));
  s.w13_expert = round_up(2 * (size_t)Is * row_bytes(fmt, Hp), 64);
  s.s13_expert = round_up(2 * (size_t)Is * scales_per_row(fmt, Hp, group), 16);
  s.w2_expert = round_up((size_t)Hp * row_bytes(fmt, Is), 64);
  s.s2_expert = Is ? round_up((size_t)Hp * scales_per_row(fmt, Is, group), 16) : 0;
  s.mapped_bytes = s.data_bytes(L.E);
  return s;
}

void place_shard(Shard& s, int E, uint8_t* base) {
  s.w13 = base;
  s.w2 = base + (size_t)E * s.w13_expert;
  s.s13 = (float*)(base + (size_t)E * (s.w13_expert + s.w2_expert));
  s.s2 = s.s13 + (size_t)E * s.s13_expert;
}

void alloc_shard(Shard& s, int E) {
  if (s.mapped_bytes == 0) return;
  void* p = mmap(nullptr, s.mapped_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                 -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("out of memory allocating expert weights");
#ifdef MADV_HUGEPAGE
  madvise(p, s.mapped_bytes, MADV_HUGEPAGE);
#endif
  s.mapping = p;
  place_shard(s, E, (uint8_t*)p);
}

std::unique_ptr<Layer> layer_geometry(int E, int I, int H, int fmt, int group) {
  if (E <= 0 || I <= 0 || H <= 0) throw std::invalid_argument("E, I and H must be positive");
  if (fmt < FMT_BF16 || fmt > FMT_INT4) throw std::invalid_argument("unknown weight format");
  if (fmt == FMT_INT4 && group != 32 && group != 64)
    throw std::invalid_argument("int4 group_size must be 32 or 64");
  auto L = std::make_unique<Layer>();
  L->E = E;
  L->H = H;
  L->I = I;
  L->Hp = (int)round_up(H, kKAlign);
  L->fmt = fmt;
  L->group = fmt == FMT_INT4 ? group : 0;
  return L;
}

}  // namespace moe_impl

using namespace moe_impl;

std::unique_ptr<Layer> ExpertPool::plan_layer(int E, int I, int H, int fmt, int group,
                                              bool packed) const {
  auto L = layer_geometry(E, I, H, fmt, group);
  L->packed = packed && fmt != FMT_BF16;
  // Split the padded intermediate dimension among nodes in chunks of kKAlign, by worker count.
  const auto& nodes = workers_->nodes();
  const int chunks = (int)(round_up(I, kKAlign) / kKAlign);
  const int total_threads = workers_->size();
  int chunk_at = 0;
  for (size_t n = 0; n < nodes.size(); ++n) {
    int mine = (int)((int64_t)chunks * (nodes[n].first_worker + nodes[n].num_threads) /
                     total_threads) - chunk_at;
    if (n + 1 == nodes.size()) mine = chunks - chunk_at;
    L->shards.push_back(plan_shard(*L, chunk_at * kKAlign, mine * kKAlign));
    chunk_at += mine;
  }
  return L;
}

void ExpertPool::add_layer(int layer, const void* w13, const void* w2, int src_dtype, int E,
                           int I, int H, int fmt, int group) {
  if (src_dtype < SRC_F32 || src_dtype > SRC_F16) throw std::invalid_argument("bad source dtype");
  auto L = plan_layer(E, I, H, fmt, group, pack_rows_);
  workers_->wait();
  // Untouched anonymous pages: the node's own workers touch them first while converting.
  for (Shard& s : L->shards) alloc_shard(s, E);
  std::vector<std::atomic<int>> counters(2 * L->shards.size());
  for (auto& c : counters) c.store(0);
  Layer* raw = L.get();
  workers_->start([&, raw](int w) { run_convert(w, raw, w13, w2, src_dtype, counters.data()); });
  workers_->wait();
  layers_[layer] = std::move(L);
}

void ExpertPool::run_convert(int worker, Layer* L, const void* w13, const void* w2, int dtype,
                             std::atomic<int>* counters) {
  const int ni = workers_->node_of(worker);
  const Shard& s = L->shards[ni];
  if (s.Is == 0) return;
  const int E = L->E, H = L->H, I = L->I, Hp = L->Hp, fmt = L->fmt, group = L->group;
  const bool packed = L->packed;
  const size_t rb13 = row_bytes(fmt, Hp), rb2 = row_bytes(fmt, s.Is);
  const int spr13 = scales_per_row(fmt, Hp, group), spr2 = scales_per_row(fmt, s.Is, group);
  std::vector<float> row(std::max(Hp, s.Is)), full;
  const int nb = s.Is / 32;
  for (int i; (i = counters[2 * ni].fetch_add(1)) < E * nb;) {
    const int e = i / nb, b = i % nb;
    for (int j = 0; j < 64; ++j) {
      const int gi = s.i0 + b * 32 + (j % 32);
      std::fill(row.begin(), row.end(), 0.f);
      if (gi < I) load_src(w13, dtype, ((size_t)e * 2 * I + (j < 32 ? 0 : I) + gi) * H, H, row.data());
      const size_t r = (size_t)b * 64 + j;
      convert_row(fmt, group, packed, row.data(), Hp, s.w13 + e * s.w13_expert + r * rb13,
                  s.s13 + e * s.s13_expert + r * spr13);
    }
  }
  const int nh = Hp / 64;
  for (int i; (i = counters[2 * ni + 1].fetch_add(1)) < E * nh;) {
    const int e = i / nh, hb = i % nh;
    for (int j = 0; j < 64; ++j) {
      const int h = hb * 64 + j;
      std::fill(row.begin(), row.end(), 0.f);
      float amax = -1.f;
      if (h < H && fmt == FMT_INT8) {
        full.resize(I);
        load_src(w2, dtype, ((size_t)e * H + h) * I, I, full.data());
        amax = 0.f;
        for (float v : full) amax = std::max(amax, std::fabs(v));
      }
      if (h < H && s.Iv > 0) load_src(w2, dtype, ((size_t)e * H + h) * I + s.i0, s.Iv, row.data());
      convert_row(fmt, group, packed, row.data(), s.Is, s.w2 + e * s.w2_expert + (size_t)h * rb2,
                  s.s2 + e * s.s2_expert + (size_t)h * spr2, amax);
    }
  }
}

void ExpertPool::dequantize(int layer_idx, float* w13, float* w2,
                            const std::vector<int>& experts) {
  workers_->wait();
  const Layer& L = layer(layer_idx);
  const int fmt = L.fmt, Hp = L.Hp, H = L.H, I = L.I;
  for (int e : experts)
    if (e < 0 || e >= L.E) throw std::invalid_argument("expert id out of range");
  const int n = experts.empty() ? L.E : (int)experts.size();
  for (const Shard& s : L.shards) {
    if (s.Is == 0) continue;
    std::vector<float> row(std::max(Hp, s.Is));
    for (int j = 0; j < n; ++j) {
      const int e = experts.empty() ? j : experts[j];
      const WeightView v13{fmt, s.w13 + e * s.w13_expert, row_bytes(fmt, Hp),
                           s.s13 + e * s.s13_expert, L.group, L.packed};
      for (int r = 0; r < 2 * s.Is; ++r) {
        const int gi = s.i0 + (r / 64) * 32 + (r % 32);
        if (gi >= I) continue;
        dequant_row(v13, r, Hp, row.data());
        const int src = (r % 64) < 32 ? gi : I + gi;
        std::memcpy(w13 + ((size_t)j * 2 * I + src) * H, row.data(), sizeof(float) * H);
      }
      const WeightView v2{fmt, s.w2 + e * s.w2_expert, row_bytes(fmt, s.Is),
                          s.s2 + e * s.s2_expert, L.group, L.packed};
      for (int h = 0; h < H; ++h) {
        dequant_row(v2, h, s.Is, row.data());
        std::memcpy(w2 + ((size_t)j * H + h) * I + s.i0, row.data(), sizeof(float) * s.Iv);
      }
    }
  }
}

}  // namespace tandem_cpu
