// Helper threads that join a call only if they are awake for it: the caller claims blocks of
// work itself, and never waits for a helper that has not started (on a shared 2-core machine
// a sleeping or descheduled helper would otherwise stall every call; qlinear's ~120 calls a
// decoded token are tens of microseconds each). A helper spins a little after each call,
// then sleeps until the next. Plain C++; knows nothing of kernels.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem_cpu {

class HelperCrew {
 public:
  using Job = void (*)(void* ctx, int block);

  HelperCrew(int num_helpers, int spin_us);
  ~HelperCrew();
  HelperCrew(const HelperCrew&) = delete;
  HelperCrew& operator=(const HelperCrew&) = delete;

  // job(ctx, b) for every b in [0, blocks), each exactly once, on the caller and any helper
  // that is awake; returns when all are done. One call at a time (the caller serializes).
  void run(int blocks, Job job, void* ctx);
  int size() const { return (int)threads_.size(); }

 private:
  void loop();
  // Claims the next block of generation gen; -1 when that job has none left (or is gone).
  int claim(uint32_t gen, int blocks);

  // generation << 32 | next block; kClosed while the caller rewrites the job below.
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int> blocks_{0};
  std::atomic<Job> job_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int> done_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int> sleepers_{0};
  int spin_us_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> threads_;
};

}  // namespace tandem_cpu
