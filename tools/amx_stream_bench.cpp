// How fast the AMX int8 tiles can stream expert weights, per access pattern (session 11). Every
// thread takes work items of 64 rows x K s8 bytes (one pool work item of a 2048-wide expert) from
// a shared counter and runs one 16-token block of row16-style tiles over them (2 A tiles, hi/lo
// B tiles, 4 tdpbssd per 64-byte chunk), or just reads them, over a buffer larger than L3 (or a
// small one that L3 holds). Prints GB/s of weight bytes per variant:
//   read        AVX-512 loads of the item in address order (the bandwidth to beat)
//   read_rpair  AVX-512 loads in the tiles' order (32 rows, chunk by chunk)
//   rpair       the pool's loop (ext/cpu/kernels_amx_int8.cpp row16_tiles): A tiles straight from
//               the rows (stride K), the next 32 rows prefetched to L2 over the chunks
//   rpair_nopf  the same without the prefetch
//   rtile       16 rows at a time (fewer concurrent streams), no prefetch
//   tilemajor   the rows stored tile by tile (each A tile 1 KB contiguous, stride 64)
//   ahead       rpair, plus the next item (claimed one ahead) prefetched to L2 in address order
//   stage       per 16 rows: copied with AVX-512 loads to an L1/L2 buffer, tiles from it
//   g++ -O2 -std=c++17 -mavx512f -mavx512bw -mamx-tile -mamx-int8 -pthread \
//     -o /tmp/amx_stream tools/amx_stream_bench.cpp && /tmp/amx_stream [threads] [MB] [K] [blocks]
// Linux only; needs a CPU with AMX.
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {
struct alignas(64) Cfg {
  uint8_t palette, start, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure() {
  Cfg c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

enum Variant { READ, READ_RPAIR, RPAIR, RPAIR_NOPF, RTILE, TILEMAJOR, AHEAD, STAGE, L1A1, L1AB1, L1AB2, L1AB4,
               TM_L1, L1_X, L1A2, NVAR };
const char* kNames[NVAR] = {"read", "read_rpair", "rpair", "rpair_nopf", "rtile", "tilemajor", "ahead", "stage",
                            "l1_a1", "l1_ab1", "l1_ab2", "l1_ab4", "tm_l1", "l1_x", "l1_a2"};

int K = 2048, kRows = 64, kBlocks = 1;
std::atomic<long> counter{0};
std::atomic<int> ready{0};
std::atomic<bool> go{false};
volatile int sink;

struct Thread {
  uint8_t* B;        // hi/lo B tiles of one token block: K / 64 chunks x 2 KB
  int32_t* stage;    // 4 C tiles
  int8_t* rows;      // stage: 16 rows x K
};

// One token block over rows [r0, r0 + 32) with A tiles at a0 / a1 (stride lda), B from th.B.
// pf: the next r-pair (chunk-major, rows ldp apart) to L2 over the chunks; seq: seq_lines lines
// from seq in address order to L2, spread over the chunks.
inline void rpair_block(const int8_t* a0, const int8_t* a1, size_t lda, const Thread& th,
                        const int8_t* pf, size_t pf_lines, size_t ldp, const int8_t* seq = nullptr,
                        size_t seq_lines = 0, int l1_dist = 0, bool l1_b = false) {
  const int chunks = K / 64;
  const size_t per = (pf_lines + chunks - 1) / chunks, seq_per = (seq_lines + chunks - 1) / chunks;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int c = 0; c < chunks; ++c) {
    if (pf)
      for (size_t i = c * per; i < std::min(pf_lines, (c + 1) * per); ++i)
        _mm_prefetch((const char*)(pf + (i % 32) * ldp + (i / 32) * 64), _MM_HINT_T1);
    if (seq && seq_lines == 0 && c == chunks - 1) {
      // the next block's first chunk (32 rows of stride ldp) to L1
      for (int r = 0; r < 32; ++r) _mm_prefetch((const char*)(seq + (size_t)r * ldp), _MM_HINT_T0);
    } else if (seq)
      for (size_t i = c * seq_per; i < std::min(seq_lines, (c + 1) * seq_per); ++i)
        _mm_prefetch((const char*)(seq + i * 64), _MM_HINT_T1);
    if (l1_dist && lda == 64 && c + l1_dist < chunks) {
      // tile-major: chunk c + l1_dist is 2 KB contiguous
      for (int l = 0; l < 32; ++l)
        _mm_prefetch((const char*)(a0 + (size_t)(c + l1_dist) * 2048 + l * 64), _MM_HINT_T0);
    } else if (l1_dist && c + l1_dist < chunks) {
      // chunk c + l1_dist's A rows (and B tiles) to L1
      const int cn = c + l1_dist;
      for (int r = 0; r < 16; ++r) {
        _mm_prefetch((const char*)(a0 + (size_t)r * lda + (size_t)cn * 64), _MM_HINT_T0);
        _mm_prefetch((const char*)(a1 + (size_t)r * lda + (size_t)cn * 64), _MM_HINT_T0);
      }
      if (l1_b)
        for (int l = 0; l < 32; ++l) _mm_prefetch((const char*)(th.B + (size_t)cn * 2048 + l * 64), _MM_HINT_T0);
    }
    const uint8_t* b = th.B + (size_t)c * 2048;
    _tile_loadd(4, a0 + (size_t)c * (lda == 64 ? 2048 : 64), lda);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + 1024, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_loadd(5, a1 + (size_t)c * (lda == 64 ? 2048 : 64), lda);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  _tile_stored(0, th.stage, 64);
  _tile_stored(1, th.stage + 256, 64);
  _tile_stored(2, th.stage + 512, 64);
  _tile_stored(3, th.stage + 768, 64);
}

inline void rtile_block(const int8_t* a, size_t lda, const Thread& th) {
  const int chunks = K / 64;
  _tile_zero(0);
  _tile_zero(1);
  for (int c = 0; c < chunks; ++c) {
    const uint8_t* b = th.B + (size_t)c * 2048;
    _tile_loadd(4, a + (size_t)c * 64, lda);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + 1024, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
  }
  _tile_stored(0, th.stage, 64);
  _tile_stored(1, th.stage + 256, 64);
}

void run_item(Variant v, const int8_t* item, const int8_t* next, const Thread& th) {
  const size_t item_bytes = (size_t)kRows * K;
  switch (v) {
    case READ: {
      __m512i acc = _mm512_setzero_si512();
      for (size_t o = 0; o < item_bytes; o += 64)
        acc = _mm512_xor_si512(acc, _mm512_load_si512((const void*)(item + o)));
      sink = _mm512_reduce_add_epi32(acc);
      break;
    }
    case READ_RPAIR: {
      __m512i acc = _mm512_setzero_si512();
      for (int r0 = 0; r0 < kRows; r0 += 32)
        for (int c = 0; c < K / 64; ++c)
          for (int r = 0; r < 32; ++r)
            acc = _mm512_xor_si512(
                acc, _mm512_load_si512((const void*)(item + (size_t)(r0 + r) * K + c * 64)));
      sink = _mm512_reduce_add_epi32(acc);
      break;
    }
    case RPAIR:
    case RPAIR_NOPF:
    case AHEAD: {
      // AHEAD: the next item's lines in address order, half over each r-pair's first block
      const size_t half = next && v == AHEAD ? item_bytes / 64 / (kRows / 32) : 0;
      for (int r0 = 0; r0 < kRows; r0 += 32) {
        const int8_t* a0 = item + (size_t)r0 * K;
        const int8_t* pf = v == RPAIR && r0 + 32 < kRows ? a0 + (size_t)32 * K : nullptr;
        for (int tb = 0; tb < kBlocks; ++tb)
          rpair_block(a0, a0 + (size_t)16 * K, K, th, tb == 0 ? pf : nullptr,
                      pf ? 32 * (size_t)K / 64 : 0, K,
                      tb == 0 && half ? next + (size_t)(r0 / 32) * half * 64 : nullptr, tb == 0 ? half : 0);
      }
      break;
    }
    case L1A1:
    case L1AB1:
    case L1AB2:
    case L1AB4: {
      const int dist = v == L1AB2 ? 2 : v == L1AB4 ? 4 : 1;
      for (int r0 = 0; r0 < kRows; r0 += 32) {
        const int8_t* a0 = item + (size_t)r0 * K;
        for (int tb = 0; tb < kBlocks; ++tb)
          rpair_block(a0, a0 + (size_t)16 * K, K, th, nullptr, 0, 0, nullptr, 0, dist, v != L1A1);
      }
      break;
    }
    case L1A2:
      for (int r0 = 0; r0 < kRows; r0 += 32) {
        const int8_t* a0 = item + (size_t)r0 * K;
        for (int tb = 0; tb < kBlocks; ++tb)
          rpair_block(a0, a0 + (size_t)16 * K, K, th, nullptr, 0, 0, nullptr, 0, 2, false);
      }
      break;
    case L1_X:
      for (int r0 = 0; r0 < kRows; r0 += 32) {
        const int8_t* a0 = item + (size_t)r0 * K;
        const int8_t* nb = r0 + 32 < kRows ? a0 + (size_t)32 * K : next;
        for (int tb = 0; tb < kBlocks; ++tb)
          rpair_block(a0, a0 + (size_t)16 * K, K, th, nullptr, 0, K, tb == kBlocks - 1 ? nb : nullptr, 0, 1,
                      false);
      }
      break;
    case TM_L1:
      for (int r0 = 0; r0 < kRows; r0 += 32) {
        const int8_t* blk = item + (size_t)r0 * K;
        for (int tb = 0; tb < kBlocks; ++tb)
          rpair_block(blk, blk + 1024, 64, th, nullptr, 0, 0, nullptr, 0, 1, false);
      }
      break;
    case RTILE:
      for (int r0 = 0; r0 < kRows; r0 += 16)
        for (int tb = 0; tb < kBlocks; ++tb) rtile_block(item + (size_t)r0 * K, K, th);
      break;
    case TILEMAJOR:
      // r-pair block of 32 rows x K: chunk c at c * 2 KB, A0 then A1 (1 KB each, stride 64)
      for (int r0 = 0; r0 < kRows; r0 += 32) {
        const int8_t* blk = item + (size_t)r0 * K;
        for (int tb = 0; tb < kBlocks; ++tb) rpair_block(blk, blk + 1024, 64, th, nullptr, 0, 0);
      }
      break;
    case STAGE:
      for (int r0 = 0; r0 < kRows; r0 += 16) {
        const int8_t* src = item + (size_t)r0 * K;
        for (size_t o = 0; o < (size_t)16 * K; o += 64)
          _mm512_store_si512((void*)(th.rows + o), _mm512_load_si512((const void*)(src + o)));
        asm volatile("" ::: "memory");
        for (int tb = 0; tb < kBlocks; ++tb) rtile_block(th.rows, K, th);
      }
      break;
    default:
      break;
  }
}

void worker(int tid, int ncpu, Variant v, const int8_t* buf, long items, long total) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET((tid + 1) % ncpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  Thread th;
  th.B = (uint8_t*)std::aligned_alloc(64, (size_t)K / 64 * 2048);
  th.stage = (int32_t*)std::aligned_alloc(64, 4096);
  th.rows = (int8_t*)std::aligned_alloc(64, (size_t)16 * K);
  for (size_t i = 0; i < (size_t)K / 64 * 2048; ++i) th.B[i] = (uint8_t)(i * 7);
  std::memset(th.rows, 1, (size_t)16 * K);
  configure();
  ready.fetch_add(1);
  while (!go.load()) {
  }
  const size_t item_bytes = (size_t)kRows * K;
  long i = counter.fetch_add(1);
  while (i < total) {
    const long nx = counter.fetch_add(1);
    const int8_t* next = nx < total ? buf + (size_t)(nx % items) * item_bytes : nullptr;
    run_item(v, buf + (size_t)(i % items) * item_bytes, next, th);
    i = nx;
  }
  _tile_release();
  std::free(th.B);
  std::free(th.stage);
  std::free(th.rows);
}

double run(int threads, int ncpu, Variant v, const int8_t* buf, long items, int passes) {
  counter = 0;
  ready = 0;
  go = false;
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back(worker, t, ncpu, v, buf, items, items * passes);
  while (ready.load() < threads) {
  }
  const auto t0 = std::chrono::steady_clock::now();
  go = true;
  for (auto& t : ts) t.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) {
    std::perror("arch_prctl(ARCH_REQ_XCOMP_PERM)");
    return 1;
  }
  const int ncpu = (int)std::thread::hardware_concurrency();
  const int threads = argc > 1 ? std::atoi(argv[1]) : ncpu - 1;
  const long mb = argc > 2 ? std::atol(argv[2]) : 1024;
  K = argc > 3 ? std::atoi(argv[3]) : 2048;
  kBlocks = argc > 4 ? std::atoi(argv[4]) : 1;
  const size_t item_bytes = (size_t)kRows * K;
  const long items = (long)((size_t)mb * 1048576 / item_bytes);
  const size_t bytes = (size_t)items * item_bytes;
  int8_t* buf = (int8_t*)std::aligned_alloc(4096, bytes);
  // first touch from the worker cpus' node (one node here), any pattern
  std::vector<std::thread> fill;
  for (int t = 0; t < threads; ++t)
    fill.emplace_back([=] {
      for (size_t o = (size_t)t * 4096; o < bytes; o += (size_t)threads * 4096)
        std::memset(buf + o, (int)(o >> 12) & 127, 4096);
    });
  for (auto& t : fill) t.join();
  std::printf("threads %d, buffer %ld MB, K %d, %d token block(s) of 16, items of %d rows\n", threads,
              mb, K, kBlocks, kRows);
  for (int rep = 0; rep < 2; ++rep)
    for (int v = 0; v < NVAR; ++v) {
      if (const char* only = std::getenv("VARIANTS"))
        if (std::string(" ") .append(only).append(" ").find(std::string(" ") + kNames[v] + " ") == std::string::npos)
          continue;
      int passes = 1;
      double s = run(threads, ncpu, (Variant)v, buf, items, passes);
      if (s < 0.3) {
        passes = std::max(1, (int)(0.3 / s));
        s = run(threads, ncpu, (Variant)v, buf, items, passes);
      }
      std::printf("  %-11s %8.1f GB/s  (%d passes, %.3f s)\n", kNames[v], bytes * (double)passes / s / 1e9,
                  passes, s);
    }
  return 0;
}
