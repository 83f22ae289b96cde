// Worker threads grouped by NUMA node and pinned to that node's cores. Runs one job at a time:
// every worker calls job(worker_id) once; the job splits its own work (atomic counters).
// Knows nothing about experts.
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

  int size() const { return (int)threads_.size(); }
  const std::vector<NodeInfo>& nodes() const { return nodes_; }  // nodes with >= 1 worker
  int node_of(int worker) const { return worker_node_[worker]; }
  // Nanoseconds each worker has spent inside jobs since it started (for utilisation metrics).
  std::vector<uint64_t> busy_ns() const;

 private:
  void loop(int worker, int cpu);

  std::vector<NodeInfo> nodes_;
  std::vector<int> worker_node_;
  std::vector<std::thread> threads_;
  std::function<void(int)> job_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<bool> stop_{false};
  std::unique_ptr<std::atomic<uint64_t>[]> busy_ns_;
  bool busy_ = false;
};

// Spins (then yields) until counter >= target. Used as a one-shot barrier inside a job.
void spin_until(const std::atomic<int>& counter, int target);

}  // namespace tandem_cpu
