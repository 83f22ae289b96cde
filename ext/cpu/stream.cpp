#include "stream.h"

#include <dlfcn.h>

#include <chrono>
#include <cstring>
#include <stdexcept>

namespace tandem_cpu {
namespace {

// Our own declarations of the two driver entry points we use (no CUDA headers at build time).
// CUresult is an int enum, CUstream an opaque pointer, CUhostFn `void (*)(void*)`.
using HostFn = void (*)(void*);
using LaunchHostFunc = int (*)(void* stream, HostFn fn, void* user);
using GetErrorString = int (*)(int error, const char** text);

struct Driver {
  LaunchHostFunc launch = nullptr;
  GetErrorString error_string = nullptr;
  std::string error;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver out;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);  // torch's copy
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* why = dlerror();
      out.error = std::string("cannot load libcuda.so.1 (the CUDA driver), needed for the CPU "
                              "expert pool's CUDA path: ") + (why ? why : "not found");
      return out;
    }
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

void enqueue(uintptr_t stream, HostFn fn, StreamJob* job) {
  const Driver& d = driver();
  if (!d.launch) throw std::runtime_error(d.error);
  if (!job) throw std::invalid_argument("null stream job");
  const int rc = d.launch(reinterpret_cast<void*>(stream), fn, job);
  if (rc != 0) {
    const char* text = nullptr;
    if (d.error_string) d.error_string(rc, &text);
    throw std::runtime_error("cuLaunchHostFunc failed (CUresult " + std::to_string(rc) +
                             (text ? std::string(": ") + text : std::string()) + ")");
  }
}

}  // namespace

std::string cuda_driver_error() { return driver().error; }

void enqueue_submit(uintptr_t stream, StreamJob* job) { enqueue(stream, host_submit, job); }
void enqueue_wait(uintptr_t stream, StreamJob* job) { enqueue(stream, host_wait, job); }

void run_inline(StreamJob* job) {
  host_submit(job);
  host_wait(job);
}

StreamJob* ExpertPool::make_stream_job(int layer, const float* hidden, const int64_t* ids,
                                       const float* weights, float* out,
                                       const int32_t* num_tokens, int capacity, int k) {
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
  return job;
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

void ExpertPool::stream_submit(StreamJob& job) noexcept {
  const int T = *job.num_tokens;
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
