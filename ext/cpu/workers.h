// Worker threads grouped by NUMA node and pinned to that node's cores. Runs one job at a time:
// every worker calls job(worker_id) once; the job splits its own work (atomic counters).
// After a job each worker spins (pause) for spin_us before it sleeps, so the next job of a
// forward (the next layer, tens of microseconds later) needs no wake-up (nor any lock: a worker
// that sees the new job while spinning takes it without the mutex); wait() spins as long
// before it sleeps too. Knows nothing about experts.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tandem_cpu {

struct NodeInfo {
  int node_id = 0;
  std::vector<int> cpus;     // allowed cpus of this node
  int num_threads = 0;       // workers placed on it
  int first_worker = 0;      // workers [first_worker, first_worker + num_threads)
};

class Workers {
 public:
  // num_threads <= 0: one fewer than the allowed cpus (at least one), leaving a core to the caller.
  // split_nodes > 0 (tests): pretend the allowed cpus form that many NUMA nodes.
  explicit Workers(int num_threads, int split_nodes = 0);
  ~Workers();
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;

  // Starts job on every worker and returns; the pool must be idle (call wait() first).
  void start(std::function<void(int)> job);
  // Blocks until the running job (if any) has finished on every worker.
  void wait();
  bool busy();
  // How long workers (and wait()) spin before sleeping; 0 = sleep at once.
  void set_spin_us(int us) { spin_us_.store(us < 0 ? 0 : us, std::memory_order_relaxed); }
  int spin_us() const { return spin_us_.load(std::memory_order_relaxed); }

  int size() const { return (int)threads_.size(); }
  const std::vector<NodeInfo>& nodes() const { return nodes_; }  // nodes with >= 1 worker
  int node_of(int worker) const { return worker_node_[worker]; }
  // Nanoseconds each worker has spent inside jobs since it started (for utilisation metrics).
  std::vector<uint64_t> busy_ns() const;
  // Allowed cpus no worker is pinned to (ascending).
  const std::vector<int>& spare_cpus() const { return spare_cpus_; }

 private:
  void loop(int worker, int cpu);

  std::vector<NodeInfo> nodes_;
  std::vector<int> worker_node_;
  std::vector<int> spare_cpus_;
  std::vector<std::thread> threads_;
  std::function<void(int)> job_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::atomic<uint64_t> generation_{0};  // jobs started
  std::atomic<uint64_t> done_{0};        // generation of the last job that finished everywhere
  std::atomic<int> remaining_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int> spin_us_{kDefaultSpinUs};
  std::unique_ptr<std::atomic<uint64_t>[]> busy_ns_;

 public:
  static constexpr int kDefaultSpinUs = 200;
};

// Spins (then yields) until counter >= target. Used as a one-shot barrier inside a job.
void spin_until(const std::atomic<int>& counter, int target);

// The calling thread onto one cpu (best effort: an error leaves it where it was).
void pin_to_cpu(int cpu);

// One spin-wait step (the x86 `pause` hint; nothing elsewhere).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

}  // namespace tandem_cpu
