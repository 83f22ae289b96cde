#include "stream.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace tandem_cpu {
namespace {

// Our own declarations of the two driver entry points we use (no CUDA headers at build time).
// CUresult is an int enum, CUstream an opaque pointer, CUhostFn `void (*)(void*)`.
using HostFn = void (*)(void*);
using LaunchHostFunc = int (*)(void* stream, HostFn fn, void* user);
using GetErrorString = int (*)(int error, const char** text);
// cuStreamWriteValue32 / cuStreamWaitValue32 (CUdeviceptr is 64-bit, cuuint32_t 32-bit) and
// cuMemHostGetDevicePointer (host pointer -> CUdeviceptr of pinned memory).
using WriteValue32 = int (*)(void* stream, uint64_t addr, uint32_t value, unsigned flags);
using WaitValue32 = int (*)(void* stream, uint64_t addr, uint32_t value, unsigned flags);
using HostGetDevicePointer = int (*)(uint64_t* dptr, void* p, unsigned flags);
constexpr unsigned kWaitValueEq = 0x1;  // CU_STREAM_WAIT_VALUE_EQ
constexpr unsigned kWriteValueDefault = 0x0;  // with a memory barrier before the write

struct Driver {
  LaunchHostFunc launch = nullptr;
  GetErrorString error_string = nullptr;
  WriteValue32 write32 = nullptr;
  WaitValue32 wait32 = nullptr;
  HostGetDevicePointer host_dev_ptr = nullptr;
  std::string error, memops_error;
};

void* symbol(void* lib, const char* v2, const char* v1) {
  void* f = dlsym(lib, v2);
  return f ? f : dlsym(lib, v1);
}

const Driver& driver() {
  static const Driver d = [] {
    Driver out;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);  // torch's copy
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* why = dlerror();
      out.error = std::string("cannot load libcuda.so.1 (the CUDA driver), needed for the CPU "
                              "expert pool's CUDA path: ") + (why ? why : "not found");
      out.memops_error = out.error;
      return out;
    }
    out.write32 = (WriteValue32)symbol(lib, "cuStreamWriteValue32_v2", "cuStreamWriteValue32");
    out.wait32 = (WaitValue32)symbol(lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32");
    out.host_dev_ptr = (HostGetDevicePointer)symbol(lib, "cuMemHostGetDevicePointer_v2",
                                                    "cuMemHostGetDevicePointer");
    if (!out.write32 || !out.wait32)
      out.memops_error = "libcuda.so.1 has no cuStreamWriteValue32/cuStreamWaitValue32";
    // The legacy-stream variant: handle 0 means the legacy default stream, as in torch.
    out.launch = (LaunchHostFunc)dlsym(lib, "cuLaunchHostFunc");
    out.error_string = (GetErrorString)dlsym(lib, "cuGetErrorString");
    if (!out.launch) out.error = "libcuda.so.1 has no cuLaunchHostFunc (CUDA driver older than 10.0)";
    return out;
  }();
  return d;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The host functions. They run on a CUDA driver thread: no CUDA calls, no Python, no GIL.
void host_submit(void* user) {
  StreamJob* job = static_cast<StreamJob*>(user);
  if (job->pool) job->pool->stream_submit(*job);
}

void host_wait(void* user) {
  StreamJob* job = static_cast<StreamJob*>(user);
  if (job->pool) job->pool->stream_wait(*job);
}

void check(int rc, const char* what) {
  if (rc == 0) return;
  const char* text = nullptr;
  if (driver().error_string) driver().error_string(rc, &text);
  throw std::runtime_error(std::string(what) + " failed (CUresult " + std::to_string(rc) +
                           (text ? std::string(": ") + text : std::string()) + ")");
}

void enqueue(uintptr_t stream, HostFn fn, StreamJob* job) {
  const Driver& d = driver();
  if (!d.launch) throw std::runtime_error(d.error);
  if (!job) throw std::invalid_argument("null stream job");
  check(d.launch(reinterpret_cast<void*>(stream), fn, job), "cuLaunchHostFunc");
}

// The device address of a word of pinned host memory (the host address itself under UVA when
// the driver has no answer).
uint64_t device_address(uint32_t* p) {
  uint64_t dptr = 0;
  if (driver().host_dev_ptr && driver().host_dev_ptr(&dptr, p, 0) == 0 && dptr) return dptr;
  return reinterpret_cast<uint64_t>(p);
}

StreamJob* flag_job(StreamJob* job) {
  const Driver& d = driver();
  if (!d.memops_error.empty()) throw std::runtime_error(d.memops_error);
  if (!job || !job->go) throw std::invalid_argument("not a flag stream job");
  if (!job->go_dev) {
    job->done_dev = device_address(job->done);
    job->go_dev = device_address(job->go);
  }
  return job;
}

}  // namespace

std::string cuda_driver_error() { return driver().error; }
std::string cuda_memops_error() { return driver().memops_error; }

void enqueue_submit(uintptr_t stream, StreamJob* job) { enqueue(stream, host_submit, job); }
void enqueue_wait(uintptr_t stream, StreamJob* job) { enqueue(stream, host_wait, job); }

void enqueue_go(uintptr_t stream, StreamJob* job, int rows) {
  flag_job(job);
  if (rows < 0 || rows > job->capacity)
    throw std::invalid_argument("rows out of range [0, capacity]");
  check(driver().write32(reinterpret_cast<void*>(stream), job->go_dev, (uint32_t)rows + 1,
                         kWriteValueDefault),
        "cuStreamWriteValue32");
}

void enqueue_done_wait(uintptr_t stream, StreamJob* job) {
  flag_job(job);
  void* s = reinterpret_cast<void*>(stream);
  check(driver().wait32(s, job->done_dev, 1, kWaitValueEq), "cuStreamWaitValue32");
  check(driver().write32(s, job->done_dev, 0, kWriteValueDefault), "cuStreamWriteValue32");
}

void host_go(StreamJob* job, int rows) {
  if (!job || !job->go) throw std::invalid_argument("not a flag stream job");
  __atomic_store_n(job->go, (uint32_t)rows + 1, __ATOMIC_RELEASE);
}

bool host_done_wait(StreamJob* job, double timeout_s) {
  if (!job || !job->done) throw std::invalid_argument("not a flag stream job");
  const int64_t deadline = now_ns() + (int64_t)(timeout_s * 1e9);
  while (__atomic_load_n(job->done, __ATOMIC_ACQUIRE) != 1) {
    if (now_ns() > deadline) return false;
    cpu_relax();
  }
  __atomic_store_n(job->done, 0u, __ATOMIC_RELAXED);
  return true;
}

void run_inline(StreamJob* job) {
  host_submit(job);
  host_wait(job);
}

StreamJob* ExpertPool::make_stream_job(int layer, const float* hidden, const int64_t* ids,
                                       const float* weights, float* out,
                                       const int32_t* num_tokens, int capacity, int k,
                                       uint32_t* flags) {
  const Layer& L = this->layer(layer);  // throws invalid_argument for an unknown layer
  if (capacity <= 0 || k <= 0) throw std::invalid_argument("capacity and k must be positive");
  StreamJob* job = new StreamJob();
  job->pool = this;
  job->layer = layer;
  job->capacity = capacity;
  job->k = k;
  job->H = L.H;
  job->hidden = hidden;
  job->ids = ids;
  job->weights = weights;
  job->out = out;
  job->num_tokens = num_tokens;
  std::lock_guard<std::mutex> lk(stream_mu_);
  stream_jobs_.push_back(job);
  if (flags) {
    const int n = num_flag_jobs_.load();
    if (n >= kMaxFlagJobs) throw std::runtime_error("too many flag stream jobs");
    job->go = flags;
    job->done = flags + 16;  // its own cache line
    __atomic_store_n(job->go, 0u, __ATOMIC_RELAXED);
    __atomic_store_n(job->done, 0u, __ATOMIC_RELAXED);
    flag_jobs_[n] = job;
    num_flag_jobs_.store(n + 1, std::memory_order_release);
    kick();
    if (!poller_.joinable()) poller_ = std::thread([this] { poll_loop(); });
  }
  return job;
}

void ExpertPool::kick() noexcept {
  kick_ns_.store(now_ns(), std::memory_order_relaxed);
}

// One thread looks at every flag job's `go` word, starting after the last one that ran (the
// next layer of a forward is usually the next job). A job it finds it runs to the end on the
// workers, then raises `done`. While jobs keep coming it spins; poll_spin_us after the last
// one (or kick) it naps kNapUs between looks, so an idle server costs no core.
void ExpertPool::poll_loop() noexcept {
  constexpr int kNapUs = 50;
  // On a core of its own where the workers left one (the highest spare cpu; the lowest stays
  // for the caller's event loop): a spinning worker or the engine thread sharing its core
  // would delay every layer's start.
  const std::vector<int>& spare = workers_->spare_cpus();
  if (!spare.empty()) pin_to_cpu(spare.back());
  int next = 0;
  int64_t last_active = now_ns();
  unsigned spins = 0;
  while (!poller_stop_.load(std::memory_order_acquire)) {
    const int n = num_flag_jobs_.load(std::memory_order_acquire);
    bool ran = false;
    for (int i = 0; i < n; ++i) {
      const int j = (next + i) % n;
      StreamJob* job = flag_jobs_[j];
      const uint32_t v = __atomic_load_n(job->go, __ATOMIC_ACQUIRE);
      if (v == 0) continue;
      __atomic_store_n(job->go, 0u, __ATOMIC_RELAXED);
      stream_start(*job, (int)v - 1);
      stream_wait(*job);
      flag_runs_.fetch_add(1, std::memory_order_relaxed);
      __atomic_store_n(job->done, 1u, __ATOMIC_RELEASE);  // after the output rows
      next = (j + 1) % n;
      ran = true;
      break;
    }
    if (ran) {
      last_active = now_ns();
      continue;
    }
    if ((++spins & 255) != 0) {
      cpu_relax();
      continue;
    }
    const int64_t now = now_ns();
    const int64_t since = now - std::max(last_active, kick_ns_.load(std::memory_order_relaxed));
    if (since > (int64_t)poll_spin_us_.load(std::memory_order_relaxed) * 1000)
      std::this_thread::sleep_for(std::chrono::microseconds(kNapUs));
  }
}

void ExpertPool::stop_poller() noexcept {
  poller_stop_.store(true, std::memory_order_release);
  if (poller_.joinable()) poller_.join();
}

void ExpertPool::stream_error(StreamJob& job, const char* what) noexcept {
  s_errors_.fetch_add(1, std::memory_order_relaxed);
  if (job.tokens > 0) std::memset(job.out, 0, sizeof(float) * (size_t)job.tokens * job.H);
  try {
    std::lock_guard<std::mutex> lk(stream_mu_);
    last_error_ = what;
  } catch (...) {
  }
}

void ExpertPool::stream_submit(StreamJob& job) noexcept { stream_start(job, *job.num_tokens); }

void ExpertPool::stream_start(StreamJob& job, int T) noexcept {
  job.tokens = 0;
  if (T < 0 || T > job.capacity) {
    stream_error(job, "stream job: token count out of range [0, capacity]");
    return;
  }
  job.tokens = T;
  job.t_submit_ns = now_ns();
  try {
    submit(job.layer, job.hidden, job.ids, true, job.weights, job.out, T, job.k);
  } catch (const std::exception& e) {
    stream_error(job, e.what());
    job.tokens = -1;  // wait: nothing to wait for, the output is already zeroed
  } catch (...) {
    stream_error(job, "stream job: unknown error in submit");
    job.tokens = -1;
  }
}

void ExpertPool::stream_wait(StreamJob& job) noexcept {
  if (job.tokens < 0) return;
  const int64_t t0 = now_ns();
  try {
    workers_->wait();
  } catch (...) {
  }
  const int64_t t1 = now_ns();
  if (failed_.load()) {
    stream_error(job, "CPU expert pool: out of memory for scratch buffers");
    return;
  }
  const uint64_t T = (uint64_t)job.tokens, H = (uint64_t)job.H, k = (uint64_t)job.k;
  s_calls_.fetch_add(1, std::memory_order_relaxed);
  s_tokens_.fetch_add(T, std::memory_order_relaxed);
  s_pool_ns_.fetch_add((uint64_t)(t1 - job.t_submit_ns), std::memory_order_relaxed);
  s_wait_ns_.fetch_add((uint64_t)(t1 - t0), std::memory_order_relaxed);
  // hidden f32 + ids i64 + weights f32 (+ the token count) down; the f32 output up.
  s_d2h_.fetch_add(T * (4 * H + 12 * k) + 4, std::memory_order_relaxed);
  s_h2d_.fetch_add(T * 4 * H, std::memory_order_relaxed);
}

StreamStats ExpertPool::stream_stats() const {
  StreamStats s;
  s.calls = s_calls_.load();
  s.errors = s_errors_.load();
  s.tokens = s_tokens_.load();
  s.pool_ns = s_pool_ns_.load();
  s.wait_ns = s_wait_ns_.load();
  s.d2h_bytes = s_d2h_.load();
  s.h2d_bytes = s_h2d_.load();
  return s;
}

std::string ExpertPool::last_stream_error() const {
  std::lock_guard<std::mutex> lk(stream_mu_);
  return last_error_;
}

}  // namespace tandem_cpu
