#include "moe.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <stdexcept>

#include "isa.h"

namespace tandem_cpu {
namespace {

inline size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

inline int64_t mono_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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

// quantize_row, in the packed order when `packed` (int8/int4).
void convert_row(int fmt, int group, bool packed, const float* x, int K, uint8_t* dst,
                 float* scales, float amax = -1.f) {
  const bool pack = packed && fmt != FMT_BF16;
  quantize_row(fmt, group, x, K, dst, scales, amax, pack ? pack_map(fmt, K) : nullptr);
}

// Rows [0, R) of w (packed int8/int4), natural, one at a time: where the CPU has no
// vnni_unpack_rows (a layer file packed elsewhere).
void unpack_rows_portable(const WeightView& w, int R, int K, uint8_t* dst) {
  const size_t rb = row_bytes(w.fmt, K);
  for (int r = 0; r < R; ++r)
    repack_row(w.fmt, K, w.data + (size_t)r * w.row_bytes, dst + (size_t)r * rb, /*pack=*/false);
}


// The geometry of a node's shard [i0, i0 + Is) of L (sizes only, no memory).
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

// Points the shard's arrays into `base`: [w13 of every expert][w2][s13][s2].
void place_shard(Shard& s, int E, uint8_t* base) {
  s.w13 = base;
  s.w2 = base + (size_t)E * s.w13_expert;
  s.s13 = (float*)(base + (size_t)E * (s.w13_expert + s.w2_expert));
  s.s2 = s.s13 + (size_t)E * s.s13_expert;
}

// Untouched anonymous pages for a shard; whoever writes them first places them on its node.
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

// One expert between the one-node layout `full` (i0 = 0, Is = I padded) and a node shard `s`:
// w13/s13 rows of the shard are a contiguous run of full's (blocks of 32 gate + 32 up rows);
// w2/s2 rows are column slices (i0 is a multiple of 64, so of int4 packs and groups too). int8
// w2 row scales come from the whole row, so every shard holds the same ones.
void copy_expert(const Layer& L, const Shard& full, const Shard& s, int e, bool to_shard) {
  if (s.Is == 0) return;
  const int fmt = L.fmt, group = L.group, Hp = L.Hp;
  auto cp = [to_shard](const void* f, const void* sh, size_t n) {
    if (to_shard) std::memcpy((void*)sh, f, n);
    else std::memcpy((void*)f, sh, n);
  };
  const size_t rb13 = row_bytes(fmt, Hp), spr13 = scales_per_row(fmt, Hp, group);
  const size_t row0 = (size_t)s.i0 * 2;  // first w13 row of the shard: i0 / 32 blocks of 64
  cp(full.w13 + e * full.w13_expert + row0 * rb13, s.w13 + e * s.w13_expert, 2 * s.Is * rb13);
  if (spr13)
    cp(full.s13 + e * full.s13_expert + row0 * spr13, s.s13 + e * s.s13_expert,
       2 * s.Is * spr13 * sizeof(float));
  const size_t rb2f = row_bytes(fmt, full.Is), rb2 = row_bytes(fmt, s.Is);
  const size_t col0 = row_bytes(fmt, s.i0);
  const size_t spr2f = scales_per_row(fmt, full.Is, group), spr2 = scales_per_row(fmt, s.Is, group);
  const size_t scol0 = fmt == FMT_INT4 ? (size_t)s.i0 / group : 0;
  // Packed rows are packed per row length: a column slice of a packed row is not the packed
  // shard row, so those go through the natural order.
  const bool repack = L.packed && full.Is != s.Is;
  std::vector<uint8_t> nat(repack ? rb2f : 0);
  for (int h = 0; h < Hp; ++h) {
    uint8_t* frow = full.w2 + e * full.w2_expert + h * rb2f;
    uint8_t* srow = s.w2 + e * s.w2_expert + h * rb2;
    if (!repack) {
      cp(frow + col0, srow, rb2);
    } else if (to_shard) {
      repack_row(fmt, full.Is, frow, nat.data(), /*pack=*/false);
      repack_row(fmt, s.Is, nat.data() + col0, srow, /*pack=*/true);
    } else {  // read-modify-write: the other shards' columns of the row stay
      repack_row(fmt, full.Is, frow, nat.data(), /*pack=*/false);
      repack_row(fmt, s.Is, srow, nat.data() + col0, /*pack=*/false);
      repack_row(fmt, full.Is, nat.data(), frow, /*pack=*/true);
    }
    if (spr2)
      cp(full.s2 + e * full.s2_expert + h * spr2f + scol0, s.s2 + e * s.s2_expert + h * spr2,
         spr2 * sizeof(float));
  }
}

constexpr size_t kCacheHeaderBytes = 4096;  // data starts page-aligned
constexpr char kCacheMagic[8] = {'T', 'N', 'D', 'M', 'X', 'P', 'C', '1'};

struct CacheHeader {
  char magic[8];
  uint32_t version;
  int32_t E, I, H, Hp, fmt, group, Is, packed;
  uint64_t w13_expert, s13_expert, w2_expert, s2_expert, data_bytes;
  char key[160];  // NUL-terminated
  uint64_t data_sample;  // FNV-1a of sampled data lines (data_sample_checksum)
  uint64_t checksum;  // FNV-1a of the bytes above
};

uint64_t fnv1a(uint64_t x, const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) x = (x ^ p[i]) * 1099511628211ull;
  return x;
}

constexpr uint64_t kFnvBasis = 1469598103934665603ull;

uint64_t header_checksum(const CacheHeader& h) {
  return fnv1a(kFnvBasis, (const uint8_t*)&h, offsetof(CacheHeader, checksum));
}

// The data lines a header's data_sample covers: kSampleLines 64-byte lines evenly spread over
// the data, and its last line. Cheap to check at every start (a few thousand bytes a layer, no
// full read of a file that is memory-mapped); it catches data replaced, zeroed or left
// half-written, not a flipped byte between two sampled lines.
constexpr size_t kSampleLines = 1024;

template <typename ReadLine>
uint64_t data_sample_checksum(size_t data_bytes, ReadLine read_line) {
  uint64_t x = kFnvBasis;
  uint8_t line[64];
  auto take = [&](size_t off) {
    const size_t n = std::min<size_t>(64, data_bytes - off);
    read_line(off, line, n);
    x = fnv1a(x, line, n);
  };
  if (data_bytes == 0) return x;
  for (size_t i = 0; i < kSampleLines; ++i) take(data_bytes / 64 * i / kSampleLines * 64);
  take(data_bytes - std::min<size_t>(64, data_bytes));
  return x;
}

CacheHeader make_header(const Layer& L, const Shard& full, const std::string& key) {
  CacheHeader h;
  std::memset(&h, 0, sizeof(h));
  if (key.size() >= sizeof(h.key)) throw std::invalid_argument("cache key too long");
  std::memcpy(h.magic, kCacheMagic, sizeof(h.magic));
  h.version = kLayoutVersion;
  h.E = L.E;
  h.I = L.I;
  h.H = L.H;
  h.Hp = L.Hp;
  h.fmt = L.fmt;
  h.group = L.group;
  h.Is = full.Is;
  h.packed = L.packed ? 1 : 0;
  h.w13_expert = full.w13_expert;
  h.s13_expert = full.s13_expert;
  h.w2_expert = full.w2_expert;
  h.s2_expert = full.s2_expert;
  h.data_bytes = full.mapped_bytes;
  std::memcpy(h.key, key.data(), key.size());
  h.checksum = header_checksum(h);
  return h;
}

// A layer's sizes, with no shards and nothing allocated; throws invalid_argument when bad.
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

// Reads the header of the cache file open as `fd` and checks it against the expected values
// (negative / check_key false: not checked), its own layout and the file's size. Throws
// invalid_argument naming `path` and the mismatch; the caller closes `fd`.
CacheHeader read_checked_header(int fd, const std::string& path, bool check_key,
                                const std::string& key, int E, int I, int H, int fmt, int group,
                                size_t* file_bytes) {
  struct stat st;
  CacheHeader h;
  const bool readable = fstat(fd, &st) == 0 && (size_t)st.st_size >= kCacheHeaderBytes &&
                        pread(fd, &h, sizeof(h), 0) == (ssize_t)sizeof(h);
  auto fail = [&](const std::string& why) { throw std::invalid_argument(path + ": " + why); };
  if (!readable) fail("shorter than its header");
  if (std::memcmp(h.magic, kCacheMagic, sizeof(h.magic)) != 0) fail("not an expert cache file");
  if (h.checksum != header_checksum(h)) fail("header checksum mismatch (corrupted)");
  if (h.version != kLayoutVersion)
    fail("layout version " + std::to_string(h.version) + ", expected " +
         std::to_string(kLayoutVersion));
  if ((E >= 0 && h.E != E) || (I >= 0 && h.I != I) || (H >= 0 && h.H != H))
    fail("shape mismatch");
  if ((fmt >= 0 && h.fmt != fmt) || (group >= 0 && h.fmt == FMT_INT4 && h.group != group))
    fail("format mismatch");
  const std::string file_key(h.key, strnlen(h.key, sizeof(h.key)));
  if (file_key.size() == sizeof(h.key)) fail("bad header: unterminated key");
  if (check_key && file_key != key) fail("key mismatch");
  std::unique_ptr<Layer> L;
  try {
    L = layer_geometry(h.E, h.I, h.H, h.fmt, h.group);
  } catch (const std::invalid_argument& e) {
    fail(std::string("bad header: ") + e.what());
  }
  if (h.packed != 0 && (h.packed != 1 || h.fmt == FMT_BF16)) fail("bad header: packed flag");
  L->packed = h.packed == 1;
  const Shard full = plan_shard(*L, 0, (int)round_up(L->I, kKAlign));
  CacheHeader want = make_header(*L, full, file_key);
  want.data_sample = h.data_sample;  // from the data, checked below
  want.checksum = header_checksum(want);
  if (std::memcmp(&want, &h, sizeof(h)) != 0) fail("layout mismatch");
  const size_t size = kCacheHeaderBytes + full.mapped_bytes;
  if ((size_t)st.st_size != size)
    fail("size " + std::to_string(st.st_size) + " bytes, expected " + std::to_string(size));
  bool read_ok = true;
  const uint64_t sample = data_sample_checksum(full.mapped_bytes, [&](size_t off, uint8_t* dst,
                                                                      size_t n) {
    read_ok = read_ok && pread(fd, dst, n, (off_t)(kCacheHeaderBytes + off)) == (ssize_t)n;
  });
  if (!read_ok) fail("cannot read its data");
  if (sample != h.data_sample) fail("data checksum mismatch (corrupted or partly written)");
  *file_bytes = size;
  return h;
}

}  // namespace

Layer::~Layer() {
  for (auto& s : shards)
    if (s.mapping) munmap(s.mapping, s.mapped_bytes);
}

size_t Layer::weight_bytes() const {
  size_t total = 0;
  for (const auto& s : shards) total += s.data_bytes(E);
  return total;
}

ExpertPool::ExpertPool(int num_threads, const std::string& isa, int split_nodes)
    : kernels_(select_kernels(isa)),
      ikernels_(select_int_kernels(kernels_.name, FMT_INT4)),
      ikernels8_(select_int_kernels(kernels_.name, FMT_INT8)) {
  int_min_tokens_ = !ikernels_.name                              ? 0
                   : std::string(ikernels_.name) == "amx-int8" ? kAmxIntMinTokens
                                                                : kVnniMinTokens;
  pack_rows_ = ikernels_.name != nullptr;
  unpack_rows_ = unpack_rows_portable;
#ifdef TANDEM_HAVE_VNNI
  if (cpu_caps().vnni) unpack_rows_ = vnni_unpack_rows;
#endif
  workers_ = std::make_unique<Workers>(num_threads, split_nodes);
  scratch_.resize(workers_->size());
  scratch_failed_.assign(workers_->size(), 0);
  for (size_t i = 0; i < workers_->nodes().size(); ++i)
    node_state_.push_back(std::make_unique<NodeState>());
}

ExpertPool::~ExpertPool() {
  stop_poller();  // finishes a flag job already started, then runs no more
  workers_->wait();
  std::lock_guard<std::mutex> lk(stream_mu_);
  for (StreamJob* job : stream_jobs_) job->pool = nullptr;  // a late host function: no-op
}

void ExpertPool::set_int_min_tokens(int n) {
  if (n < 0) throw std::invalid_argument("int_min_tokens must be >= 0");
  if (n > 0 && !ikernels_.name)
    throw std::invalid_argument(std::string("no integer path for CPU ISA '") + kernels_.name +
                                "' (needs avx512 with VNNI, or amx)");
  workers_->wait();
  int_min_tokens_ = n;
}

PhaseStats ExpertPool::phase_stats() const {
  PhaseStats p;
  p.calls = ph_calls_.load();
  p.tokens = ph_tokens_.load();
  p.pairs = ph_pairs_.load();
  p.active_experts = ph_active_.load();
  p.route_ns = ph_route_.load();
  p.job_ns = ph_job_.load();
  for (int i = 0; i < kNumPhases; ++i) {
    p.wall_ns[i] = ph_wall_[i].load();
    p.busy_ns[i] = ph_busy_[i].load();
  }
  p.int_experts = ph_int_experts_.load();
  p.float_experts = ph_float_experts_.load();
  p.int_items = ph_int_items_.load();
  p.float_items = ph_float_items_.load();
  return p;
}

void ExpertPool::reset_phase_stats() {
  workers_->wait();
  for (auto* c : {&ph_calls_, &ph_tokens_, &ph_pairs_, &ph_active_, &ph_route_, &ph_job_,
                  &ph_int_experts_, &ph_float_experts_, &ph_int_items_, &ph_float_items_})
    c->store(0);
  for (int i = 0; i < kNumPhases; ++i) {
    ph_wall_[i].store(0);
    ph_busy_[i].store(0);
  }
}

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

void ExpertPool::save_layer(int layer_idx, const std::string& path, const std::string& key) {
  workers_->wait();
  const Layer& L = layer(layer_idx);
  const Shard full = plan_shard(L, 0, (int)round_up(L.I, kKAlign));
  CacheHeader h = make_header(L, full, key);
  const size_t size = kCacheHeaderBytes + full.mapped_bytes;
  // Written under a temporary name and renamed over `path` once complete, so an interrupted
  // save never leaves a file that looks whole.
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("cannot create " + tmp + ": " + std::strerror(errno));
  // Reserve the blocks first: writing through a mapping of a sparse file on a full disk would
  // raise SIGBUS instead of an error.
  int err = posix_fallocate(fd, 0, (off_t)size);
  void* p = MAP_FAILED;
  if (err == 0) {
    p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) err = errno;
  }
  if (err != 0) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw std::runtime_error("cannot write " + path + ": " + std::strerror(err));
  }
  uint8_t* base = (uint8_t*)p;
  Shard dst = full;
  place_shard(dst, L.E, base + kCacheHeaderBytes);
  for (const Shard& s : L.shards)
    for (int e = 0; e < L.E; ++e) copy_expert(L, dst, s, e, /*to_shard=*/false);
  const uint8_t* data = base + kCacheHeaderBytes;
  h.data_sample = data_sample_checksum(
      full.mapped_bytes, [&](size_t off, uint8_t* d, size_t n) { std::memcpy(d, data + off, n); });
  h.checksum = header_checksum(h);
  std::memcpy(base, &h, sizeof(h));  // the header last
  munmap(p, size);
  err = ::fsync(fd) == 0 ? 0 : errno;
  ::close(fd);
  if (err == 0 && ::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    throw std::runtime_error("cannot write " + path + ": " + std::strerror(err));
  }
}

void ExpertPool::load_layer(int layer_idx, const std::string& path, bool check_key,
                            const std::string& key, int E, int I, int H, int fmt, int group) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::invalid_argument("cannot open " + path + ": " + std::strerror(errno));
  size_t size = 0;
  CacheHeader h;
  try {
    h = read_checked_header(fd, path, check_key, key, E, I, H, fmt, group, &size);
  } catch (...) {
    ::close(fd);
    throw;
  }
  std::unique_ptr<Layer> L = plan_layer(h.E, h.I, h.H, h.fmt, h.group, h.packed == 1);  // checked
  const Shard full = plan_shard(*L, 0, (int)round_up(L->I, kKAlign));
  void* p = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw std::runtime_error("cannot map " + path + ": " + std::strerror(errno));
  Shard src = full;
  place_shard(src, L->E, (uint8_t*)p + kCacheHeaderBytes);
  workers_->wait();
  if (L->shards.size() == 1) {  // the file is the layout: map it, pages come in on first use
    src.mapping = p;
    src.mapped_bytes = size;
    L->shards[0] = src;
  } else {
    try {
      for (Shard& s : L->shards) alloc_shard(s, L->E);
    } catch (...) {
      munmap(p, size);
      throw;
    }
    std::vector<std::atomic<int>> counters(L->shards.size());
    for (auto& c : counters) c.store(0);
    Layer* raw = L.get();
    workers_->start([&, raw](int w) {
      const int ni = workers_->node_of(w);
      for (int e; (e = counters[ni].fetch_add(1)) < raw->E;)
        copy_expert(*raw, src, raw->shards[ni], e, /*to_shard=*/true);
    });
    workers_->wait();
    munmap(p, size);
  }
  layers_[layer_idx] = std::move(L);
}

void check_layer_file(const std::string& path, bool check_key, const std::string& key, int E,
                      int I, int H, int fmt, int group) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::invalid_argument("cannot open " + path + ": " + std::strerror(errno));
  size_t size = 0;
  try {
    read_checked_header(fd, path, check_key, key, E, I, H, fmt, group, &size);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
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

void ExpertPool::submit(int layer_idx, const float* hidden, const void* ids, bool ids_int64,
                        const float* weights, float* out, int T, int k) {
  workers_->wait();
  const int64_t t_start = mono_ns();
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
  L_ = L;  // kernels_for reads its format
  // Path per expert: the integer path for int8/int4 experts with enough tokens.
  const int na = (int)active_.size();
  use_int_.assign(na, 0);
  int n_int = 0;
  if (L->fmt != FMT_BF16 && int_min_tokens_ > 0)
    for (int a = 0; a < na; ++a) n_int += use_int_[a] = count_[a] >= int_min_tokens_;
  // Per-node buffers (grown, never shrunk).
  for (size_t n = 0; n < node_state_.size(); ++n) {
    NodeState& ns = *node_state_[n];
    const Shard& sh = L->shards[n];
    ns.next = 0;
    if (ns.sync_size < na) {
      ns.sync.reset(new ExpertSync[na]);
      ns.sync_size = na;
    }
    for (int a = 0; a < na; ++a) {
      ns.sync[a].x.store(0, std::memory_order_relaxed);
      ns.sync[a].gu.store(0, std::memory_order_relaxed);
      ns.sync[a].a.store(0, std::memory_order_relaxed);
    }
    ns.x_off.resize(na + 1);
    ns.a_off.resize(na + 1);
    ns.x_off[0] = ns.a_off[0] = 0;
    for (int a = 0; a < na; ++a) {
      const KernelSet& ks = kernels_for(a);
      ns.x_off[a + 1] = ns.x_off[a] + round_up(ks.prep_bytes(L->Hp, count_[a]), 64);
      ns.a_off[a + 1] = ns.a_off[a] + round_up(ks.prep_bytes(sh.Is, count_[a]), 64);
    }
    if (sh.Is == 0) continue;
    if (ns.xprep.size() < ns.x_off[na]) ns.xprep.resize(ns.x_off[na]);
    if (ns.aprep.size() < ns.a_off[na]) ns.aprep.resize(ns.a_off[na]);
    if (ns.act.size() < (size_t)pairs * sh.Is) ns.act.resize((size_t)pairs * sh.Is);
    if (ns.y.size() < (size_t)T * k * L->Hp) ns.y.resize((size_t)T * k * L->Hp);
  }
  hidden_ = hidden;
  weights_ = weights;
  out_ = out;
  T_ = T;
  k_ = k;
  reduce_ = 0;
  global_barrier_ = 0;
  workers_done_ = 0;
  size_t nodes_used = 0;
  for (const Shard& sh : L->shards) nodes_used += sh.Is > 0;
  ph_calls_.fetch_add(1, std::memory_order_relaxed);
  ph_tokens_.fetch_add(T, std::memory_order_relaxed);
  ph_pairs_.fetch_add(pairs, std::memory_order_relaxed);
  ph_active_.fetch_add(na, std::memory_order_relaxed);
  ph_int_experts_.fetch_add(n_int * nodes_used, std::memory_order_relaxed);
  ph_float_experts_.fetch_add((na - n_int) * nodes_used, std::memory_order_relaxed);
  t_start_ns_ = t_start;
  t_wake_ns_ = mono_ns();
  ph_route_.fetch_add(t_wake_ns_ - t_start, std::memory_order_relaxed);
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

// run_step: a worker's run of consecutive items is 1/(kClaimDiv * workers) of those left.
constexpr int kClaimDiv = 4;

void ExpertPool::run_step(int worker) {
  int64_t t_mark = mono_ns();  // end of the last phase, for wall (worker 0) and busy times
  const bool timer = worker == 0;
  if (timer) ph_wall_[PH_WAKE].fetch_add(t_mark - t_wake_ns_, std::memory_order_relaxed);
  // busy(p) after a phase's work: the time since t_mark (its start) into its busy time.
  // wall(p) after its barrier: worker 0 adds the time since the previous barrier; t_mark = now.
  auto busy = [&](int phase) {
    const int64_t now = mono_ns();
    ph_busy_[phase].fetch_add(now - t_mark, std::memory_order_relaxed);
    return now;
  };
  int64_t t_phase = t_mark;
  auto wall = [&](int phase) {
    t_mark = mono_ns();
    if (timer) ph_wall_[phase].fetch_add(t_mark - t_phase, std::memory_order_relaxed);
    t_phase = t_mark;
  };
  const int ni = workers_->node_of(worker);
  NodeState& ns = *node_state_[ni];
  const int nt = workers_->nodes()[ni].num_threads;
  const Layer& L = *L_;
  const Shard& sh = L.shards[ni];
  const int na = (int)active_.size(), H = L.H, Hp = L.Hp, Is = sh.Is, fmt = L.fmt;
  const size_t ctile = round_up((size_t)max_count_ * kRowBlock * sizeof(float), 64);
  const int Kmax = std::max(Hp, Is);
  size_t kbytes = kernel_scratch_bytes(kernels_, kRowBlock, Kmax);
  for (const KernelSet* ks : {&ikernels_, &ikernels8_})
    if (ks->name) kbytes = std::max(kbytes, kernel_scratch_bytes(*ks, kRowBlock, Kmax));
  // A work item's rows, natural, for a kernel that does not read packed ones.
  const size_t ubytes = L.packed ? round_up((size_t)kRowBlock * row_bytes(fmt, Kmax), 64) : 0;
  uint8_t* scratch = scratch_for(worker, ctile + ubytes + kbytes + 64);
  if (!scratch) failed_.store(true);
  float* C = (float*)scratch;  // [tokens][kRowBlock]
  uint8_t* unpacked = scratch + ctile;
  uint8_t* kscratch = scratch + ctile + ubytes;
  // w as the kernel of expert a reads it: packed rows as they are, or natural ones.
  auto view_for = [&](int a, const WeightView& w, int K) {
    if (!w.packed || kernels_for(a).reads_packed) return w;
    unpack_rows_(w, kRowBlock, K, unpacked);
    return WeightView{fmt, unpacked, row_bytes(fmt, K), w.scales, w.group, false};
  };
  thread_local std::vector<const float*> rows;
  if (Is > 0) {
    // The node's work items, in this order on one counter (ns.next):
    //   P(a): expert a's tokens in its kernel's layout (xprep), for every expert first;
    //   G(a, b): gate/up rows [32 b, 32 b + 32) of expert a (32 + 32 per item), then SiLU * up;
    //            the last of an expert's G items to finish also lays out its activations (aprep);
    //   D(a, h): down rows [64 h, 64 h + 64) of expert a.
    // Each item waits (spins) only for its own expert's inputs, which sit earlier in the order,
    // so no phase waits for the slowest worker of the one before, and the preps overlap weight
    // reads. A worker takes the P items one at a time, then runs of consecutive items, a
    // 1/(kClaimDiv * workers) share of what is left (at least 1): early runs span several
    // experts, whose prepared tokens then stay in the worker's own caches for all their items
    // instead of crossing between cores item by item; the last runs are single items, so
    // workers still finish together.
    const size_t rb13 = row_bytes(fmt, Hp), rb2 = row_bytes(fmt, Is);
    const int spr13 = scales_per_row(fmt, Hp, L.group), spr2 = scales_per_row(fmt, Is, L.group);
    const int nb1 = Is / 32, nb2 = Hp / kRowBlock;
    const int n_pg = na + na * nb1, n_items = n_pg + na * nb2;
    ExpertSync* es = ns.sync.get();
    int64_t ns_in[kNumPhases] = {};  // this worker's busy time per phase (added once, at the end)
    uint64_t int_items = 0, items = 0;
    bool in_down = false;
    auto wait_for = [&](const std::atomic<int>& flag) {
      if (flag.load(std::memory_order_acquire)) return;
      const int64_t t0 = mono_ns();
      spin_until(flag, 1);
      ns_in[PH_STALL] += mono_ns() - t0;
    };
    auto prep_x = [&](int a) {
      const int64_t t0 = mono_ns();
      rows.resize(count_[a]);
      for (int p = 0; p < count_[a]; ++p) rows[p] = hidden_ + (size_t)pair_token_[first_[a] + p] * H;
      kernels_for(a).prep(rows.data(), H, Hp, count_[a], ns.xprep.data() + ns.x_off[a]);
      es[a].x.store(1, std::memory_order_release);
      ns_in[PH_PREP_X] += mono_ns() - t0;
    };
    auto prep_act = [&](int a) {
      const int64_t t0 = mono_ns();
      rows.resize(count_[a]);
      for (int p = 0; p < count_[a]; ++p) rows[p] = ns.act.data() + (size_t)(first_[a] + p) * Is;
      kernels_for(a).prep(rows.data(), Is, Is, count_[a], ns.aprep.data() + ns.a_off[a]);
      es[a].a.store(1, std::memory_order_release);
      ns_in[PH_PREP_ACT] += mono_ns() - t0;
    };
    auto gate_up = [&](int a, int b) {
      const int e = active_[a], n = count_[a];
      wait_for(es[a].x);
      if (scratch) {
        const int64_t t0 = mono_ns();
        const WeightView w = view_for(
            a,
            {fmt, sh.w13 + e * sh.w13_expert + (size_t)b * 64 * rb13, rb13,
             sh.s13 + e * sh.s13_expert + (size_t)b * 64 * spr13, L.group, L.packed},
            Hp);
        kernels_for(a).gemm(w, kRowBlock, Hp, ns.xprep.data() + ns.x_off[a], n, C, kRowBlock,
                            kscratch);
        ++items;
        int_items += use_int_[a];
        const int64_t t_silu = mono_ns();
        for (int p = 0; p < n; ++p) {
          const float* c = C + (size_t)p * kRowBlock;
          float* dst = ns.act.data() + (size_t)(first_[a] + p) * Is + b * 32;
          if (kernels_.silu_mul) {
            kernels_.silu_mul(c, c + 32, dst, 32);
          } else {
            for (int j = 0; j < 32; ++j) dst[j] = c[j] / (1.f + std::exp(-c[j])) * c[32 + j];
          }
        }
        ns_in[PH_SILU] += mono_ns() - t_silu;
        ns_in[PH_GATE_UP] += t_silu - t0;
      }
      // The last of the expert's G items (acq_rel: it sees the others' act rows) preps them.
      if (es[a].gu.fetch_add(1, std::memory_order_acq_rel) + 1 == nb1) prep_act(a);
    };
    auto down = [&](int a, int hb) {
      const int e = active_[a], n = count_[a];
      wait_for(es[a].a);
      if (!scratch) return;
      const int64_t t0 = mono_ns();
      const WeightView w = view_for(
          a,
          {fmt, sh.w2 + e * sh.w2_expert + (size_t)hb * kRowBlock * rb2, rb2,
           sh.s2 + e * sh.s2_expert + (size_t)hb * kRowBlock * spr2, L.group, L.packed},
          Is);
      kernels_for(a).gemm(w, kRowBlock, Is, ns.aprep.data() + ns.a_off[a], n, C, kRowBlock,
                          kscratch);
      ++items;
      int_items += use_int_[a];
      for (int p = 0; p < n; ++p)
        std::memcpy(ns.y.data() + (size_t)pair_slot_[first_[a] + p] * Hp + hb * kRowBlock,
                    C + (size_t)p * kRowBlock, sizeof(float) * kRowBlock);
      ns_in[PH_DOWN] += mono_ns() - t0;
    };
    auto run_item = [&](int i) {
      if (i < na) {
        prep_x(i);
      } else if (i < n_pg) {
        gate_up((i - na) / nb1, (i - na) % nb1);
      } else {
        if (!in_down) {
          in_down = true;
          wall(PH_GATE_UP);
        }
        down((i - n_pg) / nb2, (i - n_pg) % nb2);
      }
    };
    for (int cur = ns.next.load(std::memory_order_relaxed); cur < n_items;) {
      const int take = cur < na ? 1 : std::max(1, (n_items - cur) / (kClaimDiv * nt));
      if (!ns.next.compare_exchange_weak(cur, cur + take, std::memory_order_relaxed)) continue;
      for (int i = cur; i < cur + take; ++i) run_item(i);  // take <= n_items - cur
      cur = ns.next.load(std::memory_order_relaxed);
    }
    if (!in_down) wall(PH_GATE_UP);
    for (int ph = 0; ph < kNumPhases; ++ph)
      if (ns_in[ph]) ph_busy_[ph].fetch_add(ns_in[ph], std::memory_order_relaxed);
    ph_int_items_.fetch_add(int_items, std::memory_order_relaxed);
    ph_float_items_.fetch_add(items - int_items, std::memory_order_relaxed);
  }
  global_barrier_.fetch_add(1);
  spin_until(global_barrier_, workers_->size());
  wall(PH_DOWN);
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
  const int64_t t_end = busy(PH_REDUCE);
  if (timer) ph_wall_[PH_REDUCE].fetch_add(t_end - t_phase, std::memory_order_relaxed);
  // The last worker out closes the call: start of submit -> now.
  if (workers_done_.fetch_add(1) + 1 == (int)workers_->size())
    ph_job_.fetch_add(mono_ns() - t_start_ns_, std::memory_order_relaxed);
}

}  // namespace tandem_cpu
