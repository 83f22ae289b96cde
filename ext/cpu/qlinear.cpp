#include "qlinear.h"

#include <algorithm>
#include <stdexcept>

#include "isa.h"

namespace tandem_cpu {

int qtype_block_elems(int qtype) {
  switch (qtype) {
    case QT_Q4_0: case QT_Q4_1: case QT_Q8_0: case QT_INT4G: case QT_FP8: return 32;
    case QT_Q4_K: case QT_Q5_K: case QT_Q6_K: return 256;
    default: return 0;
  }
}

int qtype_block_bytes(int qtype) {
  switch (qtype) {
    case QT_Q4_0: return 18;
    case QT_Q4_1: return 20;
    case QT_Q8_0: return 34;
    case QT_Q4_K: return 144;
    case QT_Q5_K: return 176;
    case QT_Q6_K: return 210;
    case QT_INT4G: return 16;
    case QT_FP8: return 32;
    default: return 0;
  }
}

namespace {

QLinearKernels select_qlinear(const std::string& want) {
  // Same detection and errors as the expert pool; AVX-512 BF16 (and AMX machines, which have
  // it) run the vector kernel, everything else the portable one.
  const std::string name = select_kernels(want).name;
#ifdef TANDEM_HAVE_AVX512
  if (name == "avx512" || name == "amx") return qlinear_kernels_avx512();
#endif
  return qlinear_kernels_scalar();
}

QLinearKernels select_int8(const std::string& want) {
  const std::string name = select_kernels(want).name;
#ifdef TANDEM_HAVE_VNNI
  if ((name == "avx512" || name == "amx") && cpu_caps().vnni) return qlinear_kernels_vnni();
#endif
#ifdef TANDEM_HAVE_AVX2
  if (name != "scalar" && cpu_caps().avx2) return qlinear_kernels_avx2_int8();
#endif
  return {nullptr, nullptr, nullptr, nullptr};
}

}  // namespace

QLinearPool::QLinearPool(int num_threads, const std::string& isa, bool int8)
    : kernels_(select_qlinear(isa)) {
  if (int8) ints_ = select_int8(isa);
  if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1");
  if (num_threads > 1) helpers_ = std::make_unique<HelperCrew>(num_threads - 1, kHelperSpinUs);
}

QLinearPool::~QLinearPool() = default;

namespace {

struct Call {
  const QLinearKernels* k;
  const QLinearArgs* a;
  const void* xp;
};

constexpr int kBlockRows = 16;

void run_block(void* ctx, int b) {
  const Call& c = *(const Call*)ctx;
  const int r0 = b * kBlockRows;
  c.k->rows(*c.a, c.xp, r0, std::min(c.a->N, r0 + kBlockRows));
}

}  // namespace

void QLinearPool::run(const QLinearArgs& a, const void* x, bool x_bf16) {
  const int be = qtype_block_elems(a.qtype);
  if (be == 0) throw std::invalid_argument("unsupported packed weight type");
  if (a.M <= 0 || a.N <= 0 || a.K <= 0) throw std::invalid_argument("M, N and K must be positive");
  if (a.K % be) throw std::invalid_argument("K must be a multiple of the type's block");
  if (a.row_bytes != (size_t)(a.K / be) * qtype_block_bytes(a.qtype))
    throw std::invalid_argument("row_bytes does not match K and the type");
  if (a.qtype == QT_INT4G || a.qtype == QT_FP8) {
    if (std::string(kernels_.name) != "avx512")
      throw std::invalid_argument("int4-group and fp8 weights need the AVX-512 BF16 kernel");
    if (!a.scales) throw std::invalid_argument("scales missing");
    if (a.qtype == QT_INT4G && (!a.zeros || a.group < 32 || a.group % 32 || a.K % a.group))
      throw std::invalid_argument("int4-group: zeros missing or bad group");
    if (a.qtype == QT_FP8 && (a.block_rows < 1 || a.block_cols < 32 || a.block_cols % 32 ||
                              a.scale_cols != (a.K + a.block_cols - 1) / a.block_cols))
      throw std::invalid_argument("fp8: bad scale block");
  }
  const QLinearKernels& k = int8_serves(a.qtype) ? ints_ : kernels_;
  std::lock_guard<std::mutex> lk(mu_);
  const size_t need = k.prep_bytes(a.K, a.M) + 64;
  if (xprep_.size() < need) xprep_.resize(need);
  // 64-byte aligned: the int8 kernels load the activations with aligned loads.
  uint8_t* xbuf = xprep_.data() + ((64 - ((uintptr_t)xprep_.data() & 63)) & 63);
  k.prep(x, x_bf16, a.M, a.K, xbuf);
  const int blocks = (a.N + kBlockRows - 1) / kBlockRows;
  Call call{&k, &a, xbuf};
  if (!helpers_ || blocks < 2 || (size_t)a.N * a.row_bytes < kHelpMinBytes) {
    for (int b = 0; b < blocks; ++b) run_block(&call, b);
    return;
  }
  helpers_->run(blocks, run_block, &call);
}

}  // namespace tandem_cpu
