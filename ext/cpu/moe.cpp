#include "moe.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "isa.h"

namespace tandem_cpu {
namespace {

inline size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

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

// One row of K floats into the converted layout. Matches ext/cpu/reference.py::quantize.
// int8: amax is the row's absolute maximum over all its columns (not only this shard's), so the
// result does not depend on how many NUMA nodes share the row; negative means "compute it".
void quantize_row(int fmt, int group, const float* x, int K, uint8_t* dst, float* scales,
                  float amax = -1.f) {
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
      d[k] = s > 0.f ? (int8_t)std::min(127.f, std::max(-127.f, std::nearbyint(x[k] / s))) : 0;
  } else {
    // 16 levels, as GGUF's Q4_0: the element of largest magnitude (the first on ties) maps to
    // -8 exactly, so s = that element / -8 may be negative; q = round(x / s) in [-8, 7].
    std::vector<uint8_t> nib(K);
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
        const float q = s != 0.f ? std::min(7.f, std::max(-8.f, std::nearbyint(x[k] / s))) : 0.f;
        nib[k] = (uint8_t)((int)q + 8);
      }
    }
    for (int c = 0; c < K / 64; ++c)
      for (int j = 0; j < 32; ++j)
        dst[c * 32 + j] = (uint8_t)(nib[c * 64 + j] | (nib[c * 64 + 32 + j] << 4));
  }
}

}  // namespace

Layer::~Layer() {
  for (auto& s : shards)
    if (s.mapping) munmap(s.mapping, s.mapped_bytes);
}

size_t Layer::weight_bytes() const {
  size_t total = 0;
  for (const auto& s : shards)
    total += (size_t)E * (s.w13_expert + s.w2_expert + 4 * (s.s13_expert + s.s2_expert));
  return total;
}

ExpertPool::ExpertPool(int num_threads, const std::string& isa)
    : kernels_(select_kernels(isa)) {
  workers_ = std::make_unique<Workers>(num_threads);
  scratch_.resize(workers_->size());
  scratch_failed_.assign(workers_->size(), 0);
  for (size_t i = 0; i < workers_->nodes().size(); ++i)
    node_state_.push_back(std::make_unique<NodeState>());
}

ExpertPool::~ExpertPool() { workers_->wait(); }

const Layer& ExpertPool::layer(int layer) const {
  auto it = layers_.find(layer);
  if (it == layers_.end()) throw std::invalid_argument("no layer " + std::to_string(layer));
  return *it->second;
}

std::vector<int> ExpertPool::layer_ids() const {
  std::vector<int> out;
  for (const auto& kv : layers_) out.push_back(kv.first);
  return out;
}

void ExpertPool::add_layer(int layer, const void* w13, const void* w2, int src_dtype, int E,
                           int I, int H, int fmt, int group) {
  if (E <= 0 || I <= 0 || H <= 0) throw std::invalid_argument("E, I and H must be positive");
  if (fmt < FMT_BF16 || fmt > FMT_INT4) throw std::invalid_argument("unknown weight format");
  if (fmt == FMT_INT4 && group != 32 && group != 64)
    throw std::invalid_argument("int4 group_size must be 32 or 64");
  if (src_dtype < SRC_F32 || src_dtype > SRC_F16) throw std::invalid_argument("bad source dtype");
  workers_->wait();
  auto L = std::make_unique<Layer>();
  L->E = E;
  L->H = H;
  L->I = I;
  L->Hp = (int)round_up(H, kKAlign);
  L->fmt = fmt;
  L->group = fmt == FMT_INT4 ? group : 0;
  // Split the padded intermediate dimension among nodes in chunks of kKAlign, by worker count.
  const auto& nodes = workers_->nodes();
  const int chunks = (int)(round_up(I, kKAlign) / kKAlign);
  const int total_threads = workers_->size();
  int chunk_at = 0;
  for (size_t n = 0; n < nodes.size(); ++n) {
    int mine = (int)((int64_t)chunks * (nodes[n].first_worker + nodes[n].num_threads) /
                     total_threads) - chunk_at;
    if (n + 1 == nodes.size()) mine = chunks - chunk_at;
    Shard s;
    s.i0 = chunk_at * kKAlign;
    s.Is = mine * kKAlign;
    s.Iv = std::max(0, std::min(s.Is, I - s.i0));
    chunk_at += mine;
    const int Hp = L->Hp;
    s.w13_expert = round_up(2 * (size_t)s.Is * row_bytes(fmt, Hp), 64);
    s.s13_expert = round_up(2 * (size_t)s.Is * scales_per_row(fmt, Hp, group), 16);
    s.w2_expert = round_up((size_t)Hp * row_bytes(fmt, s.Is), 64);
    s.s2_expert = s.Is ? round_up((size_t)Hp * scales_per_row(fmt, s.Is, group), 16) : 0;
    const size_t wbytes = (size_t)E * (s.w13_expert + s.w2_expert);
    const size_t sbytes = (size_t)E * (s.s13_expert + s.s2_expert) * sizeof(float);
    s.mapped_bytes = wbytes + sbytes;
    if (s.mapped_bytes > 0) {
      // Untouched anonymous pages: the node's own workers touch them first while converting.
      void* p = mmap(nullptr, s.mapped_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
      if (p == MAP_FAILED) throw std::runtime_error("out of memory allocating expert weights");
#ifdef MADV_HUGEPAGE
      madvise(p, s.mapped_bytes, MADV_HUGEPAGE);
#endif
      s.mapping = p;
      uint8_t* base = (uint8_t*)p;
      s.w13 = base;
      s.w2 = base + (size_t)E * s.w13_expert;
      s.s13 = (float*)(base + wbytes);
      s.s2 = s.s13 + (size_t)E * s.s13_expert;
    }
    L->shards.push_back(s);
  }
  std::vector<std::atomic<int>> counters(2 * nodes.size());
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
      quantize_row(fmt, group, row.data(), Hp, s.w13 + e * s.w13_expert + r * rb13,
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
      quantize_row(fmt, group, row.data(), s.Is, s.w2 + e * s.w2_expert + (size_t)h * rb2,
                   s.s2 + e * s.s2_expert + (size_t)h * spr2, amax);
    }
  }
}

void ExpertPool::dequantize(int layer_idx, float* w13, float* w2) {
  workers_->wait();
  const Layer& L = layer(layer_idx);
  const int fmt = L.fmt, Hp = L.Hp, H = L.H, I = L.I;
  for (const Shard& s : L.shards) {
    if (s.Is == 0) continue;
    std::vector<float> row(std::max(Hp, s.Is));
    for (int e = 0; e < L.E; ++e) {
      const WeightView v13{fmt, s.w13 + e * s.w13_expert, row_bytes(fmt, Hp),
                           s.s13 + e * s.s13_expert, L.group};
      for (int r = 0; r < 2 * s.Is; ++r) {
        const int gi = s.i0 + (r / 64) * 32 + (r % 32);
        if (gi >= I) continue;
        dequant_row(v13, r, Hp, row.data());
        const int src = (r % 64) < 32 ? gi : I + gi;
        std::memcpy(w13 + ((size_t)e * 2 * I + src) * H, row.data(), sizeof(float) * H);
      }
      const WeightView v2{fmt, s.w2 + e * s.w2_expert, row_bytes(fmt, s.Is),
                          s.s2 + e * s.s2_expert, L.group};
      for (int h = 0; h < H; ++h) {
        dequant_row(v2, h, s.Is, row.data());
        std::memcpy(w2 + ((size_t)e * H + h) * I + s.i0, row.data(), sizeof(float) * s.Iv);
      }
    }
  }
}

void ExpertPool::submit(int layer_idx, const float* hidden, const void* ids, bool ids_int64,
                        const float* weights, float* out, int T, int k) {
  workers_->wait();
  auto it = layers_.find(layer_idx);
  if (it == layers_.end()) throw std::invalid_argument("no layer " + std::to_string(layer_idx));
  Layer* L = it->second.get();
  failed_.store(false);
  if (T <= 0) return;
  if (k <= 0) throw std::invalid_argument("top-k must be positive");
  const int E = L->E;
  // Route: validate ids, group (token, slot) pairs by expert.
  ids_.resize((size_t)T * k);
  for (size_t i = 0; i < ids_.size(); ++i) {
    const int64_t id = ids_int64 ? ((const int64_t*)ids)[i] : ((const int32_t*)ids)[i];
    if (id < -1 || id >= E)
      throw std::invalid_argument("expert id " + std::to_string(id) + " out of range [0, " +
                                  std::to_string(E) + ") (-1 skips a slot)");
    ids_[i] = (int)id;
  }
  expert_slot_.assign(E, -1);
  std::vector<int> per_expert(E, 0);
  for (int id : ids_)
    if (id >= 0) ++per_expert[id];
  active_.clear();
  count_.clear();
  first_.clear();
  int pairs = 0;
  max_count_ = 0;
  for (int e = 0; e < E; ++e) {
    if (!per_expert[e]) continue;
    expert_slot_[e] = (int)active_.size();
    active_.push_back(e);
    count_.push_back(per_expert[e]);
    first_.push_back(pairs);
    pairs += per_expert[e];
    max_count_ = std::max(max_count_, per_expert[e]);
  }
  pair_token_.resize(pairs);
  pair_slot_.resize(pairs);
  std::vector<int> fill(first_);
  for (int s = 0; s < T * k; ++s) {
    if (ids_[s] < 0) continue;
    const int p = fill[expert_slot_[ids_[s]]]++;
    pair_token_[p] = s / k;
    pair_slot_[p] = s;
  }
  // Per-node buffers (grown, never shrunk).
  const int na = (int)active_.size();
  for (size_t n = 0; n < node_state_.size(); ++n) {
    NodeState& ns = *node_state_[n];
    const Shard& sh = L->shards[n];
    ns.prep_x = ns.gate_up = ns.prep_a = ns.down = ns.barrier = 0;
    ns.x_off.resize(na + 1);
    ns.a_off.resize(na + 1);
    ns.x_off[0] = ns.a_off[0] = 0;
    for (int a = 0; a < na; ++a) {
      ns.x_off[a + 1] = ns.x_off[a] + round_up(kernels_.prep_bytes(L->Hp, count_[a]), 64);
      ns.a_off[a + 1] = ns.a_off[a] + round_up(kernels_.prep_bytes(sh.Is, count_[a]), 64);
    }
    if (sh.Is == 0) continue;
    if (ns.xprep.size() < ns.x_off[na]) ns.xprep.resize(ns.x_off[na]);
    if (ns.aprep.size() < ns.a_off[na]) ns.aprep.resize(ns.a_off[na]);
    if (ns.act.size() < (size_t)pairs * sh.Is) ns.act.resize((size_t)pairs * sh.Is);
    if (ns.y.size() < (size_t)T * k * L->Hp) ns.y.resize((size_t)T * k * L->Hp);
  }
  L_ = L;
  hidden_ = hidden;
  weights_ = weights;
  out_ = out;
  T_ = T;
  k_ = k;
  reduce_ = 0;
  global_barrier_ = 0;
  workers_->start([this](int w) { run_step(w); });
}

void ExpertPool::sync() {
  workers_->wait();
  if (failed_.load()) throw std::runtime_error("CPU expert pool: out of memory for scratch buffers");
}

uint8_t* ExpertPool::scratch_for(int worker, size_t bytes) {
  auto& buf = scratch_[worker];
  if (buf.size() < bytes) {
    try {
      buf.resize(bytes);
    } catch (const std::bad_alloc&) {
      return nullptr;
    }
  }
  return buf.data();
}

void ExpertPool::run_step(int worker) {
  const int ni = workers_->node_of(worker);
  NodeState& ns = *node_state_[ni];
  const int nt = workers_->nodes()[ni].num_threads;
  const Layer& L = *L_;
  const Shard& sh = L.shards[ni];
  const int na = (int)active_.size(), H = L.H, Hp = L.Hp, Is = sh.Is, fmt = L.fmt;
  const size_t ctile = round_up((size_t)max_count_ * kRowBlock * sizeof(float), 64);
  uint8_t* scratch = scratch_for(worker, ctile + gemm_scratch_bytes(kRowBlock, std::max(Hp, Is)) + 64);
  if (!scratch) failed_.store(true);
  float* C = (float*)scratch;  // [tokens][kRowBlock]
  uint8_t* kscratch = scratch + ctile;
  thread_local std::vector<const float*> rows;
  if (Is > 0) {
    // Phase 0: this node's copy of every active expert's tokens, in the kernel's layout.
    for (int a; (a = ns.prep_x.fetch_add(1)) < na;) {
      if (!scratch) continue;
      rows.resize(count_[a]);
      for (int p = 0; p < count_[a]; ++p) rows[p] = hidden_ + (size_t)pair_token_[first_[a] + p] * H;
      kernels_.prep(rows.data(), H, Hp, count_[a], ns.xprep.data() + ns.x_off[a]);
    }
    ns.barrier.fetch_add(1);
    spin_until(ns.barrier, nt);
    // Phase 1: gate and up rows, 32 + 32 per item, then SiLU(gate) * up.
    const size_t rb13 = row_bytes(fmt, Hp);
    const int spr13 = scales_per_row(fmt, Hp, L.group), nb1 = Is / 32;
    for (int i; (i = ns.gate_up.fetch_add(1)) < na * nb1;) {
      if (!scratch) continue;
      const int a = i / nb1, b = i % nb1, e = active_[a], n = count_[a];
      const WeightView w{fmt, sh.w13 + e * sh.w13_expert + (size_t)b * 64 * rb13, rb13,
                         sh.s13 + e * sh.s13_expert + (size_t)b * 64 * spr13, L.group};
      kernels_.gemm(w, kRowBlock, Hp, ns.xprep.data() + ns.x_off[a], n, C, kRowBlock, kscratch);
      for (int p = 0; p < n; ++p) {
        const float* c = C + (size_t)p * kRowBlock;
        float* dst = ns.act.data() + (size_t)(first_[a] + p) * Is + b * 32;
        for (int j = 0; j < 32; ++j) dst[j] = c[j] / (1.f + std::exp(-c[j])) * c[32 + j];
      }
    }
    ns.barrier.fetch_add(1);
    spin_until(ns.barrier, 2 * nt);
    // Phase 1b: the intermediate activations in the kernel's layout.
    for (int a; (a = ns.prep_a.fetch_add(1)) < na;) {
      if (!scratch) continue;
      rows.resize(count_[a]);
      for (int p = 0; p < count_[a]; ++p) rows[p] = ns.act.data() + (size_t)(first_[a] + p) * Is;
      kernels_.prep(rows.data(), Is, Is, count_[a], ns.aprep.data() + ns.a_off[a]);
    }
    ns.barrier.fetch_add(1);
    spin_until(ns.barrier, 3 * nt);
    // Phase 2: down projection, 64 output rows per item, into per-(token, slot) rows.
    const size_t rb2 = row_bytes(fmt, Is);
    const int spr2 = scales_per_row(fmt, Is, L.group), nb2 = Hp / kRowBlock;
    for (int i; (i = ns.down.fetch_add(1)) < na * nb2;) {
      if (!scratch) continue;
      const int a = i / nb2, hb = i % nb2, e = active_[a], n = count_[a];
      const WeightView w{fmt, sh.w2 + e * sh.w2_expert + (size_t)hb * kRowBlock * rb2, rb2,
                         sh.s2 + e * sh.s2_expert + (size_t)hb * kRowBlock * spr2, L.group};
      kernels_.gemm(w, kRowBlock, Is, ns.aprep.data() + ns.a_off[a], n, C, kRowBlock, kscratch);
      for (int p = 0; p < n; ++p)
        std::memcpy(ns.y.data() + (size_t)pair_slot_[first_[a] + p] * Hp + hb * kRowBlock,
                    C + (size_t)p * kRowBlock, sizeof(float) * kRowBlock);
    }
  }
  global_barrier_.fetch_add(1);
  spin_until(global_barrier_, workers_->size());
  // Phase 3: out[t] = sum over nodes and slots of weight * expert output.
  const int k = k_;
  for (int t; (t = reduce_.fetch_add(1)) < T_;) {
    float* o = out_ + (size_t)t * H;
    bool first = true;
    for (size_t n = 0; n < node_state_.size(); ++n) {
      if (L.shards[n].Is == 0) continue;
      const float* y = node_state_[n]->y.data();
      for (int j = 0; j < k; ++j) {
        const int s = t * k + j;
        if (ids_[s] < 0) continue;
        const float wgt = weights_[s];
        const float* yr = y + (size_t)s * Hp;
        if (first) {
          for (int h = 0; h < H; ++h) o[h] = wgt * yr[h];
        } else {
          for (int h = 0; h < H; ++h) o[h] += wgt * yr[h];
        }
        first = false;
      }
    }
    if (first) std::memset(o, 0, sizeof(float) * H);
  }
}

}  // namespace tandem_cpu
