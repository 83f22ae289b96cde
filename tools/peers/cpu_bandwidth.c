// CPU memory read bandwidth: the floor of every CPU-side decode benchmark (weights are streamed
// once per step). Each thread first-touches, then reads, its own static slice of one buffer far
// larger than the last-level cache, with the widest vector loads the build allows (AVX-512,
// else AVX2, else 64-bit words). Prints "threads GB/s" lines, best of `passes` (1 GB = 1e9 B).
//   cc -O3 -march=native -fopenmp cpu_bandwidth.c -o cpu_bandwidth
//   ./cpu_bandwidth GIGABYTES THREADS[,THREADS...] [PASSES]
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#if defined(__AVX512F__)
typedef __m512i vec;
#define VZERO() _mm512_setzero_si512()
#define VLOAD(p) _mm512_load_si512(p)
#define VADD(a, b) _mm512_add_epi64(a, b)
#define VSET(x) _mm512_set1_epi64(x)
#define VSTORE(p, v) _mm512_store_si512(p, v)
static long long vsum(vec v) { return _mm512_reduce_add_epi64(v); }
#define ISA "avx512"
#elif defined(__AVX2__)
typedef __m256i vec;
#define VZERO() _mm256_setzero_si256()
#define VLOAD(p) _mm256_load_si256(p)
#define VADD(a, b) _mm256_add_epi64(a, b)
#define VSET(x) _mm256_set1_epi64x(x)
#define VSTORE(p, v) _mm256_store_si256(p, v)
static long long vsum(vec v) {
  long long t[4];
  _mm256_storeu_si256((__m256i *)t, v);
  return t[0] + t[1] + t[2] + t[3];
}
#define ISA "avx2"
#else
typedef long long vec;
#define VZERO() 0LL
#define VLOAD(p) (*(p))
#define VADD(a, b) ((a) + (b))
#define VSET(x) ((long long)(x))
#define VSTORE(p, v) (*(p) = (v))
static long long vsum(vec v) { return v; }
#define ISA "scalar"
#endif

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// this thread's [begin, end) of n vectors
static void slice(size_t n, size_t *begin, size_t *end) {
  int t = omp_get_thread_num(), nt = omp_get_num_threads();
  *begin = n * (size_t)t / (size_t)nt;
  *end = n * (size_t)(t + 1) / (size_t)nt;
}

static volatile long long keep;

static double read_pass(const vec *buf, size_t n, int threads) {
  long long total = 0;
  double start = seconds();
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    size_t i, end;
    slice(n, &i, &end);
    vec a = VZERO(), b = VZERO(), c = VZERO(), d = VZERO();
    for (; i + 4 <= end; i += 4) {  // four independent chains keep the loads in flight
      a = VADD(a, VLOAD(buf + i));
      b = VADD(b, VLOAD(buf + i + 1));
      c = VADD(c, VLOAD(buf + i + 2));
      d = VADD(d, VLOAD(buf + i + 3));
    }
    for (; i < end; i++) a = VADD(a, VLOAD(buf + i));
    total += vsum(VADD(VADD(a, b), VADD(c, d)));
  }
  double elapsed = seconds() - start;
  keep = total;
  return (double)n * sizeof(vec) / elapsed / 1e9;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s GIGABYTES THREADS[,THREADS...] [PASSES]\n", argv[0]);
    return 2;
  }
  size_t bytes = (size_t)(atof(argv[1]) * 1e9) & ~(size_t)4095;
  int passes = argc > 3 ? atoi(argv[3]) : 5;
  size_t n = bytes / sizeof(vec);
  if (n < 4 || passes < 1) {
    fprintf(stderr, "buffer too small or passes < 1\n");
    return 2;
  }
  printf("# isa %s, buffer %.3f GB, best of %d passes\n", ISA, (double)bytes / 1e9, passes);
  char list[256];
  strncpy(list, argv[2], sizeof list - 1);
  list[sizeof list - 1] = 0;
  for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
    int threads = atoi(tok);
    if (threads < 1) {
      fprintf(stderr, "bad thread count %s\n", tok);
      return 2;
    }
    vec *buf = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) {
      perror("mmap");
      return 1;
    }
    madvise(buf, bytes, MADV_HUGEPAGE);
#pragma omp parallel num_threads(threads)
    {  // first touch by the thread that reads the slice: its pages sit on that thread's node
      size_t i, end;
      slice(n, &i, &end);
      for (; i < end; i++) VSTORE(buf + i, VSET((long long)i));
    }
    double best = 0;
    for (int p = 0; p < passes; p++) {
      double gbps = read_pass(buf, n, threads);
      if (gbps > best) best = gbps;
    }
    munmap(buf, bytes);
    printf("%d %.2f\n", threads, best);
    fflush(stdout);
  }
  return 0;
}
