// The converted layer's file (the expert cache): a checked 4 KiB header, then the one-node
// layout; writing it from any node split and mapping or copying it back into the shards.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "moe.h"
#include "moe_internal.h"

namespace tandem_cpu {
namespace {

using namespace moe_impl;

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

using namespace moe_impl;

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

}  // namespace tandem_cpu
