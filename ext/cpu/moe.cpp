// The expert pool's registry and lifecycle: kernels chosen at construction, the layers it
// holds, per-layer activation settings, the integer-path threshold and the phase counters.
// Conversion: moe_convert.cpp; layer files: moe_file.cpp; a call: moe_step.cpp.
#include "moe.h"

#include <sys/mman.h>

#include <stdexcept>
#include <string>

#include "isa.h"
#include "moe_internal.h"

namespace tandem_cpu {

using namespace moe_impl;

Layer::~Layer() {
  for (auto& s : shards)
    if (s.mapping) munmap(s.mapping, s.mapped_bytes);
}

size_t Layer::weight_bytes() const {
  size_t total = 0;
  for (const auto& s : shards) total += s.data_bytes(E);
  return total;
}

ExpertPool::ExpertPool(int num_threads, const std::string& isa, int split_nodes)
    : kernels_(select_kernels(isa)),
      ikernels_(select_int_kernels(kernels_.name, FMT_INT4)),
      ikernels8_(select_int_kernels(kernels_.name, FMT_INT8)),
      ikernels4g_(select_int_kernels(kernels_.name, FMT_INT4, kTileQBlock4)) {
  int_min_tokens_ = !ikernels_.name                              ? 0
                   : std::string(ikernels_.name) == "amx-int8" ? kAmxIntMinTokens
                                                                : kVnniMinTokens;
  pack_rows_ = ikernels_.name != nullptr;
  unpack_rows_ = unpack_rows_portable;
#ifdef TANDEM_HAVE_VNNI
  if (cpu_caps().vnni) unpack_rows_ = vnni_unpack_rows;
#endif
  workers_ = std::make_unique<Workers>(num_threads, split_nodes);
  scratch_.resize(workers_->size());
  scratch_failed_.assign(workers_->size(), 0);
  for (size_t i = 0; i < workers_->nodes().size(); ++i)
    node_state_.push_back(std::make_unique<NodeState>());
}

ExpertPool::~ExpertPool() {
  stop_poller();  // finishes a flag job already started, then runs no more
  workers_->wait();
  std::lock_guard<std::mutex> lk(stream_mu_);
  for (StreamJob* job : stream_jobs_) job->pool = nullptr;  // a late host function: no-op
}

void ExpertPool::set_int_min_tokens(int n) {
  if (n < 0) throw std::invalid_argument("int_min_tokens must be >= 0");
  if (n > 0 && !ikernels_.name)
    throw std::invalid_argument(std::string("no integer path for CPU ISA '") + kernels_.name +
                                "' (needs avx512 with VNNI, or amx)");
  workers_->wait();
  int_min_tokens_ = n;
}

PhaseStats ExpertPool::phase_stats() const {
  PhaseStats p;
  p.calls = ph_calls_.load();
  p.tokens = ph_tokens_.load();
  p.pairs = ph_pairs_.load();
  p.active_experts = ph_active_.load();
  p.route_ns = ph_route_.load();
  p.job_ns = ph_job_.load();
  for (int i = 0; i < kNumPhases; ++i) {
    p.wall_ns[i] = ph_wall_[i].load();
    p.busy_ns[i] = ph_busy_[i].load();
  }
  p.int_experts = ph_int_experts_.load();
  p.float_experts = ph_float_experts_.load();
  p.int_items = ph_int_items_.load();
  p.float_items = ph_float_items_.load();
  return p;
}

void ExpertPool::reset_phase_stats() {
  workers_->wait();
  for (auto* c : {&ph_calls_, &ph_tokens_, &ph_pairs_, &ph_active_, &ph_route_, &ph_job_,
                  &ph_int_experts_, &ph_float_experts_, &ph_int_items_, &ph_float_items_})
    c->store(0);
  for (int i = 0; i < kNumPhases; ++i) {
    ph_wall_[i].store(0);
    ph_busy_[i].store(0);
  }
}

const Layer& ExpertPool::layer(int layer) const {
  auto it = layers_.find(layer);
  if (it == layers_.end()) throw std::invalid_argument("no layer " + std::to_string(layer));
  return *it->second;
}

void ExpertPool::set_expert_act(int layer_idx, const float* b13, const float* b2, int kind,
                                float alpha, float limit) {
  if (kind != ACT_SILU && kind != ACT_CLAMPED_SWIGLU)
    throw std::invalid_argument("unknown expert activation " + std::to_string(kind));
  if (kind == ACT_CLAMPED_SWIGLU && !(limit > 0.f))
    throw std::invalid_argument("the clamped SwiGLU's limit must be positive");
  workers_->wait();
  auto it = layers_.find(layer_idx);
  if (it == layers_.end()) throw std::invalid_argument("no layer " + std::to_string(layer_idx));
  Layer& L = *it->second;
  ExpertAct a;
  a.kind = kind;
  a.alpha = alpha;
  a.limit = limit;
  if (b13) a.b13.assign(b13, b13 + (size_t)L.E * 2 * L.I);
  if (b2) a.b2.assign(b2, b2 + (size_t)L.E * L.H);
  L.act = std::move(a);
}

std::vector<int> ExpertPool::layer_ids() const {
  std::vector<int> out;
  for (const auto& kv : layers_) out.push_back(kv.first);
  return out;
}

}  // namespace tandem_cpu
