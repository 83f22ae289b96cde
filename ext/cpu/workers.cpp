#include "workers.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <set>
#include <sstream>

#include <dirent.h>

namespace tandem_cpu {
namespace {

// "0-3,8-11" -> {0,1,2,3,8,9,10,11}
std::vector<int> parse_cpulist(const std::string& text) {
  std::vector<int> out;
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, ',')) {
    if (part.empty() || part == "\n") continue;
    const size_t dash = part.find('-');
    try {
      const int lo = std::stoi(part.substr(0, dash));
      const int hi = dash == std::string::npos ? lo : std::stoi(part.substr(dash + 1));
      for (int c = lo; c <= hi; ++c) out.push_back(c);
    } catch (...) {
    }
  }
  return out;
}

std::vector<int> allowed_cpus() {
  std::vector<int> out;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  if (out.empty()) {
    const unsigned n = std::thread::hardware_concurrency();
    for (unsigned c = 0; c < (n ? n : 1); ++c) out.push_back((int)c);
  }
  return out;
}

// NUMA nodes from sysfs, restricted to the cpus this process may use; one node if unknown.
// split_nodes > 0 (tests): the allowed cpus cut into that many contiguous pseudo-nodes instead.
std::vector<NodeInfo> discover_nodes(int split_nodes) {
  const std::vector<int> allowed = allowed_cpus();
  if (split_nodes > 0) {
    std::vector<NodeInfo> nodes;
    const int n = std::min<int>(split_nodes, (int)allowed.size());
    for (int i = 0; i < n; ++i) {
      NodeInfo node;
      node.node_id = i;
      for (size_t c = allowed.size() * i / n; c < allowed.size() * (i + 1) / n; ++c)
        node.cpus.push_back(allowed[c]);
      nodes.push_back(node);
    }
    return nodes;
  }
  const std::set<int> allowed_set(allowed.begin(), allowed.end());
  std::vector<NodeInfo> nodes;
  if (DIR* dir = opendir("/sys/devices/system/node")) {
    std::vector<int> ids;
    while (dirent* e = readdir(dir)) {
      const std::string name = e->d_name;
      if (name.size() > 4 && name.compare(0, 4, "node") == 0 &&
          name.find_first_not_of("0123456789", 4) == std::string::npos)
        ids.push_back(std::stoi(name.substr(4)));
    }
    closedir(dir);
    std::set<int> sorted(ids.begin(), ids.end());
    for (int id : sorted) {
      std::ifstream f("/sys/devices/system/node/node" + std::to_string(id) + "/cpulist");
      std::string text;
      std::getline(f, text);
      NodeInfo node;
      node.node_id = id;
      for (int c : parse_cpulist(text))
        if (allowed_set.count(c)) node.cpus.push_back(c);
      if (!node.cpus.empty()) nodes.push_back(node);
    }
  }
  if (nodes.empty()) {
    NodeInfo node;
    node.cpus = allowed;
    nodes.push_back(node);
  }
  return nodes;
}

}  // namespace

void pin_to_cpu(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof(set), &set);
}

void spin_until(const std::atomic<int>& counter, int target) {
  int spins = 0;
  while (counter.load(std::memory_order_acquire) < target) {
    if (++spins < 4000) cpu_relax();
    else std::this_thread::yield();
  }
}

Workers::Workers(int num_threads, int split_nodes) {
  std::vector<NodeInfo> all = discover_nodes(split_nodes);
  int total_cpus = 0;
  for (const auto& n : all) total_cpus += (int)n.cpus.size();
  if (num_threads <= 0) num_threads = total_cpus > 1 ? total_cpus - 1 : 1;
  // Share workers among nodes in proportion to their cpus, at least one per node while any
  // are left (largest remainders get the rest).
  std::vector<int> count(all.size(), 0);
  int given = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    count[i] = (int)((int64_t)num_threads * (int64_t)all[i].cpus.size() / total_cpus);
    given += count[i];
  }
  for (size_t i = 0; given < num_threads; i = (i + 1) % all.size()) {
    ++count[i];
    ++given;
  }
  int worker = 0;
  std::vector<std::pair<int, int>> placement;  // (worker, cpu)
  for (size_t i = 0; i < all.size(); ++i) {
    if (count[i] == 0) continue;
    NodeInfo node = all[i];
    node.num_threads = count[i];
    node.first_worker = worker;
    const int ncpu = (int)node.cpus.size();
    for (int j = 0; j < count[i]; ++j) {
      // From the node's last cpu down, so the first cpu stays free for the caller's event loop.
      placement.emplace_back(worker++, node.cpus[ncpu - 1 - (j % ncpu)]);
      worker_node_.push_back((int)nodes_.size());
    }
    nodes_.push_back(node);
  }
  std::set<int> used;
  for (const auto& p : placement) used.insert(p.second);
  for (const auto& n : all)
    for (int c : n.cpus)
      if (!used.count(c)) spare_cpus_.push_back(c);
  std::sort(spare_cpus_.begin(), spare_cpus_.end());
  busy_ns_.reset(new std::atomic<uint64_t>[placement.size()]);
  for (size_t i = 0; i < placement.size(); ++i) busy_ns_[i].store(0);
  for (const auto& p : placement) threads_.emplace_back([this, p] { loop(p.first, p.second); });
}

Workers::~Workers() {
  wait();
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
  }
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void Workers::start(std::function<void(int)> job) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = std::move(job);
    remaining_.store(size(), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  work_cv_.notify_all();
}

namespace {
// Spins with pause until done() or spin_us have passed; true if done() held.
template <class Done>
bool spin_for(int spin_us, Done done) {
  if (spin_us <= 0) return done();
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  for (int spins = 1;; ++spins) {
    if (done()) return true;
    cpu_relax();
    if ((spins & 63) == 0 && std::chrono::steady_clock::now() > end) return done();
  }
}
}  // namespace

void Workers::wait() {
  // A job is done when the last worker has published its generation (under mu_, so a
  // sleeper below cannot miss the notify).
  auto idle = [this] {
    return done_.load(std::memory_order_acquire) == generation_.load(std::memory_order_acquire);
  };
  if (spin_for(spin_us(), idle)) return;
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, idle);
}

std::vector<uint64_t> Workers::busy_ns() const {
  std::vector<uint64_t> out(threads_.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = busy_ns_[i].load(std::memory_order_relaxed);
  return out;
}

bool Workers::busy() {
  return done_.load(std::memory_order_acquire) != generation_.load(std::memory_order_acquire);
}

void Workers::loop(int worker, int cpu) {
  pin_to_cpu(cpu);
  uint64_t seen = 0;
  for (;;) {
    // Spin (a forward submits layer after layer), then sleep. A job seen while spinning is
    // taken without the mutex: start() wrote job_ before it published the generation
    // (release), and job_ does not change until every worker has finished this job.
    const bool woke = spin_for(spin_us(), [&] {
      return generation_.load(std::memory_order_acquire) != seen ||
             stop_.load(std::memory_order_relaxed);
    });
    if (!woke) {
      std::unique_lock<std::mutex> lk(mu_);
      work_cv_.wait(lk, [&] { return generation_.load() != seen || stop_.load(); });
    }
    const uint64_t gen = generation_.load(std::memory_order_acquire);
    if (gen == seen) return;  // stopping
    seen = gen;
    std::function<void(int)>* job = &job_;
    const auto t0 = std::chrono::steady_clock::now();
    (*job)(worker);
    busy_ns_[worker].fetch_add(
        (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::chrono::steady_clock::now() - t0).count(),
        std::memory_order_relaxed);
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lk(mu_);
      done_.store(seen, std::memory_order_release);
      done_cv_.notify_all();
    }
  }
}

}  // namespace tandem_cpu
