#include "linear.h"

#include <algorithm>
#include <stdexcept>

#include "isa.h"

namespace tandem_cpu {
namespace {

LinearKernels select_linear(const std::string& want) {
  // Same detection and errors as the expert pool; "amx" runs bf16 VNNI weights on tiles and
  // the other formats on the AVX-512 kernel.
  const KernelSet ks = select_kernels(want);
  const std::string name = ks.name;
#ifdef TANDEM_HAVE_AMX
  if (name == "amx") return linear_kernels_amx();
#endif
#ifdef TANDEM_HAVE_AVX512
  if (name == "avx512" || name == "amx") return linear_kernels_avx512();
#endif
#ifdef TANDEM_HAVE_AVX2
  if (name == "avx2") return linear_kernels_avx2();
#endif
  return linear_kernels_scalar();
}

}  // namespace

LinearPool::LinearPool(int num_threads, const std::string& isa, int parallel_min_rows)
    : kernels_(select_linear(isa)), parallel_min_rows_(parallel_min_rows) {
  if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1");
  if (num_threads > 1) workers_ = std::make_unique<Workers>(num_threads - 1);
}

LinearPool::~LinearPool() {
  if (workers_) workers_->wait();
}

void LinearPool::work(const LinearArgs& a, const void* xp, int blocks, int block_rows) {
  for (;;) {
    const int b = next_.fetch_add(1, std::memory_order_relaxed);
    if (b >= blocks) return;
    const int r0 = b * block_rows;
    kernels_.rows(a, xp, r0, std::min(a.N, r0 + block_rows));
  }
}

void LinearPool::run(const LinearArgs& a, const void* x, bool x_bf16) {
  if (a.M <= 0 || a.N <= 0 || a.K <= 0) throw std::invalid_argument("M, N and K must be positive");
  if (a.Kp < a.K || a.Kp % kKAlign) throw std::invalid_argument("Kp must be K rounded up to 64");
  if (a.fmt < FMT_BF16 || a.fmt > FMT_BF16_VNNI)
    throw std::invalid_argument("unknown weight format");
  const std::string isa = kernels_.name;
  if (a.fmt == FMT_BF16_VNNI && isa != "avx512" && isa != "amx")
    throw std::invalid_argument("the bf16 VNNI layout needs the avx512 or amx kernels");
  if (a.fmt == FMT_INT4 && a.group != 32 && a.group != 64)
    throw std::invalid_argument("int4 group must be 32 or 64");
  std::lock_guard<std::mutex> lk(mu_);
  const size_t need = kernels_.prep_bytes(a.Kp, a.M);
  if (xprep_.size() < need) xprep_.resize(need);
  kernels_.prep(x, x_bf16, a.M, a.K, a.Kp, xprep_.data());
  // Blocks of 16 rows: enough items to balance, long enough runs to stream. VNNI: 128 columns
  // (eight 16-column blocks) so that small-M calls keep eight weight streams in flight.
  const int block_rows = a.fmt == FMT_BF16_VNNI ? 128 : 16;
  const int blocks = (a.N + block_rows - 1) / block_rows;
  const void* xp = xprep_.data();
  next_.store(0, std::memory_order_relaxed);
  if (!workers_ || blocks < 2 || a.M < parallel_min_rows_) {
    work(a, xp, blocks, block_rows);
    return;
  }
  workers_->start([this, &a, xp, blocks, block_rows](int) { work(a, xp, blocks, block_rows); });
  work(a, xp, blocks, block_rows);
  workers_->wait();
}

}  // namespace tandem_cpu
