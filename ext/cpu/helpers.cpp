#include "helpers.h"

#include <chrono>

#include "workers.h"

namespace tandem_cpu {
namespace {
constexpr uint64_t kClosed = 0x7fffffffull;  // a next-block value no job reaches
}

HelperCrew::HelperCrew(int num_helpers, int spin_us) : spin_us_(spin_us < 0 ? 0 : spin_us) {
  for (int i = 0; i < num_helpers; ++i) threads_.emplace_back([this] { loop(); });
}

HelperCrew::~HelperCrew() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

int HelperCrew::claim(uint32_t gen, int blocks) {
  uint64_t t = ticket_.load(std::memory_order_acquire);
  for (;;) {
    if ((uint32_t)(t >> 32) != gen || (t & 0xffffffffull) >= (uint64_t)blocks) return -1;
    if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel))
      return (int)(t & 0xffffffffull);
  }
}

void HelperCrew::run(int blocks, Job job, void* ctx) {
  const uint32_t gen = (uint32_t)(ticket_.load(std::memory_order_relaxed) >> 32) + 1;
  // Close the old job first: a helper still holding its generation can claim nothing more,
  // and one that reads the fields below while they change fails its claim.
  ticket_.store(((uint64_t)gen << 32) | kClosed, std::memory_order_seq_cst);
  blocks_.store(blocks, std::memory_order_relaxed);
  job_.store(job, std::memory_order_relaxed);
  ctx_.store(ctx, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  ticket_.store((uint64_t)gen << 32, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lk(mu_);
    cv_.notify_all();
  }
  int mine = 0;
  for (int b; (b = claim(gen, blocks)) >= 0; ++mine) job(ctx, b);
  if (done_.fetch_add(mine, std::memory_order_acq_rel) + mine == blocks) return;
  while (done_.load(std::memory_order_acquire) < blocks) cpu_relax();  // a helper's last block
}

void HelperCrew::loop() {
  uint32_t seen = 0;
  for (;;) {
    auto fresh = [&] {
      const uint64_t t = ticket_.load(std::memory_order_seq_cst);
      return ((uint32_t)(t >> 32) != seen && (t & 0xffffffffull) != kClosed) || stop_.load();
    };
    const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
    bool woke = fresh();
    for (int spins = 1; !woke; ++spins) {
      cpu_relax();
      woke = fresh();
      if ((spins & 63) == 0 && std::chrono::steady_clock::now() > end) break;
    }
    if (!woke) {
      std::unique_lock<std::mutex> lk(mu_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      cv_.wait(lk, fresh);
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }
    if (stop_.load()) return;
    const uint64_t t = ticket_.load(std::memory_order_acquire);
    const uint32_t gen = (uint32_t)(t >> 32);
    seen = gen;
    const int blocks = blocks_.load(std::memory_order_relaxed);
    const Job job = job_.load(std::memory_order_relaxed);
    void* ctx = ctx_.load(std::memory_order_relaxed);
    int mine = 0;
    // A claim succeeds only while generation gen is open, so blocks / job / ctx were its own.
    for (int b; (b = claim(gen, blocks)) >= 0; ++mine) job(ctx, b);
    if (mine) done_.fetch_add(mine, std::memory_order_acq_rel);
  }
}

}  // namespace tandem_cpu
