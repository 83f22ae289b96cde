// One MoE call: submit routes (token, slot) pairs to experts and starts the workers; run_step
// is each worker's part of the node's work-item stream (token prep, gate/up + activation,
// down) and of the weighted sum over slots and nodes.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "moe.h"
#include "moe_act.h"
#include "moe_internal.h"

namespace tandem_cpu {

using namespace moe_impl;

void ExpertPool::submit(int layer_idx, const float* hidden, const void* ids, bool ids_int64,
                        const float* weights, float* out, int T, int k) {
  workers_->wait();
  const int64_t t_start = mono_ns();
  auto it = layers_.find(layer_idx);
  if (it == layers_.end()) throw std::invalid_argument("no layer " + std::to_string(layer_idx));
  Layer* L = it->second.get();
  failed_.store(false);
  if (T <= 0) return;
  if (k <= 0) throw std::invalid_argument("top-k must be positive");
  const int E = L->E;
  // Route: validate ids, group (token, slot) pairs by expert.
  ids_.resize((size_t)T * k);
  for (size_t i = 0; i < ids_.size(); ++i) {
    const int64_t id = ids_int64 ? ((const int64_t*)ids)[i] : ((const int32_t*)ids)[i];
    if (id < -1 || id >= E)
      throw std::invalid_argument("expert id " + std::to_string(id) + " out of range [0, " +
                                  std::to_string(E) + ") (-1 skips a slot)");
    ids_[i] = (int)id;
  }
  expert_slot_.assign(E, -1);
  std::vector<int> per_expert(E, 0);
  for (int id : ids_)
    if (id >= 0) ++per_expert[id];
  active_.clear();
  count_.clear();
  first_.clear();
  int pairs = 0;
  max_count_ = 0;
  for (int e = 0; e < E; ++e) {
    if (!per_expert[e]) continue;
    expert_slot_[e] = (int)active_.size();
    active_.push_back(e);
    count_.push_back(per_expert[e]);
    first_.push_back(pairs);
    pairs += per_expert[e];
    max_count_ = std::max(max_count_, per_expert[e]);
  }
  pair_token_.resize(pairs);
  pair_slot_.resize(pairs);
  std::vector<int> fill(first_);
  for (int s = 0; s < T * k; ++s) {
    if (ids_[s] < 0) continue;
    const int p = fill[expert_slot_[ids_[s]]]++;
    pair_token_[p] = s / k;
    pair_slot_[p] = s;
  }
  L_ = L;  // kernels_for reads its format
  // Path per expert: the integer path for int8/int4 experts with enough tokens.
  const int na = (int)active_.size();
  use_int_.assign(na, 0);
  int n_int = 0;
  if (L->fmt != FMT_BF16 && int_min_tokens_ > 0)
    for (int a = 0; a < na; ++a) n_int += use_int_[a] = count_[a] >= int_min_tokens_;
  // Per-node buffers (grown, never shrunk).
  for (size_t n = 0; n < node_state_.size(); ++n) {
    NodeState& ns = *node_state_[n];
    const Shard& sh = L->shards[n];
    ns.next = 0;
    if (ns.sync_size < na) {
      ns.sync.reset(new ExpertSync[na]);
      ns.sync_size = na;
    }
    for (int a = 0; a < na; ++a) {
      ns.sync[a].x.store(0, std::memory_order_relaxed);
      ns.sync[a].gu.store(0, std::memory_order_relaxed);
      ns.sync[a].a.store(0, std::memory_order_relaxed);
    }
    ns.x_off.resize(na + 1);
    ns.a_off.resize(na + 1);
    ns.x_off[0] = ns.a_off[0] = 0;
    for (int a = 0; a < na; ++a) {
      const KernelSet& ks = kernels_for(a);
      ns.x_off[a + 1] = ns.x_off[a] + round_up(ks.prep_bytes(L->Hp, count_[a]), 64);
      ns.a_off[a + 1] = ns.a_off[a] + round_up(ks.prep_bytes(sh.Is, count_[a]), 64);
    }
    if (sh.Is == 0) continue;
    if (ns.xprep.size() < ns.x_off[na]) ns.xprep.resize(ns.x_off[na]);
    if (ns.aprep.size() < ns.a_off[na]) ns.aprep.resize(ns.a_off[na]);
    if (ns.act.size() < (size_t)pairs * sh.Is) ns.act.resize((size_t)pairs * sh.Is);
    if (ns.y.size() < (size_t)T * k * L->Hp) ns.y.resize((size_t)T * k * L->Hp);
  }
  hidden_ = hidden;
  weights_ = weights;
  out_ = out;
  T_ = T;
  k_ = k;
  reduce_ = 0;
  global_barrier_ = 0;
  workers_done_ = 0;
  size_t nodes_used = 0;
  for (const Shard& sh : L->shards) nodes_used += sh.Is > 0;
  ph_calls_.fetch_add(1, std::memory_order_relaxed);
  ph_tokens_.fetch_add(T, std::memory_order_relaxed);
  ph_pairs_.fetch_add(pairs, std::memory_order_relaxed);
  ph_active_.fetch_add(na, std::memory_order_relaxed);
  ph_int_experts_.fetch_add(n_int * nodes_used, std::memory_order_relaxed);
  ph_float_experts_.fetch_add((na - n_int) * nodes_used, std::memory_order_relaxed);
  t_start_ns_ = t_start;
  t_wake_ns_ = mono_ns();
  ph_route_.fetch_add(t_wake_ns_ - t_start, std::memory_order_relaxed);
  workers_->start([this](int w) { run_step(w); });
}

void ExpertPool::sync() {
  workers_->wait();
  if (failed_.load()) throw std::runtime_error("CPU expert pool: out of memory for scratch buffers");
}

uint8_t* ExpertPool::scratch_for(int worker, size_t bytes) {
  auto& buf = scratch_[worker];
  if (buf.size() < bytes) {
    try {
      buf.resize(bytes);
    } catch (const std::bad_alloc&) {
      return nullptr;
    }
  }
  return buf.data();
}

// run_step: a worker's run of consecutive items is 1/(kClaimDiv * workers) of those left.
constexpr int kClaimDiv = 4;

void ExpertPool::run_step(int worker) {
  int64_t t_mark = mono_ns();  // end of the last phase, for wall (worker 0) and busy times
  const bool timer = worker == 0;
  if (timer) ph_wall_[PH_WAKE].fetch_add(t_mark - t_wake_ns_, std::memory_order_relaxed);
  // busy(p) after a phase's work: the time since t_mark (its start) into its busy time.
  // wall(p) after its barrier: worker 0 adds the time since the previous barrier; t_mark = now.
  auto busy = [&](int phase) {
    const int64_t now = mono_ns();
    ph_busy_[phase].fetch_add(now - t_mark, std::memory_order_relaxed);
    return now;
  };
  int64_t t_phase = t_mark;
  auto wall = [&](int phase) {
    t_mark = mono_ns();
    if (timer) ph_wall_[phase].fetch_add(t_mark - t_phase, std::memory_order_relaxed);
    t_phase = t_mark;
  };
  const int ni = workers_->node_of(worker);
  NodeState& ns = *node_state_[ni];
  const int nt = workers_->nodes()[ni].num_threads;
  const Layer& L = *L_;
  const Shard& sh = L.shards[ni];
  const int na = (int)active_.size(), H = L.H, Hp = L.Hp, Is = sh.Is, fmt = L.fmt;
  const bool plain_act = L.act.plain();
  const size_t ctile = round_up((size_t)max_count_ * kRowBlock * sizeof(float), 64);
  const int Kmax = std::max(Hp, Is);
  size_t kbytes = kernel_scratch_bytes(kernels_, kRowBlock, Kmax);
  for (const KernelSet* ks : {&ikernels_, &ikernels8_, &ikernels4g_})
    if (ks->name) kbytes = std::max(kbytes, kernel_scratch_bytes(*ks, kRowBlock, Kmax));
  // A work item's rows, natural, for a kernel that does not read packed ones.
  const size_t ubytes = L.packed ? round_up((size_t)kRowBlock * row_bytes(fmt, Kmax), 64) : 0;
  uint8_t* scratch = scratch_for(worker, ctile + ubytes + kbytes + 64);
  if (!scratch) failed_.store(true);
  float* C = (float*)scratch;  // [tokens][kRowBlock]
  uint8_t* unpacked = scratch + ctile;
  uint8_t* kscratch = scratch + ctile + ubytes;
  // w as the kernel of expert a reads it: packed rows as they are, or natural ones.
  auto view_for = [&](int a, const WeightView& w, int K) {
    if (!w.packed || kernels_for(a).reads_packed) return w;
    unpack_rows_(w, kRowBlock, K, unpacked);
    return WeightView{fmt, unpacked, row_bytes(fmt, K), w.scales, w.group, false};
  };
  thread_local std::vector<const float*> rows;
  if (Is > 0) {
    // The node's work items, in this order on one counter (ns.next):
    //   P(a): expert a's tokens in its kernel's layout (xprep), for every expert first;
    //   G(a, b): gate/up rows [32 b, 32 b + 32) of expert a (32 + 32 per item), then SiLU * up;
    //            the last of an expert's G items to finish also lays out its activations (aprep);
    //   D(a, h): down rows [64 h, 64 h + 64) of expert a.
    // Each item waits (spins) only for its own expert's inputs, which sit earlier in the order,
    // so no phase waits for the slowest worker of the one before, and the preps overlap weight
    // reads. A worker takes the P items one at a time, then runs of consecutive items, a
    // 1/(kClaimDiv * workers) share of what is left (at least 1): early runs span several
    // experts, whose prepared tokens then stay in the worker's own caches for all their items
    // instead of crossing between cores item by item; the last runs are single items, so
    // workers still finish together.
    const size_t rb13 = row_bytes(fmt, Hp), rb2 = row_bytes(fmt, Is);
    const int spr13 = scales_per_row(fmt, Hp, L.group), spr2 = scales_per_row(fmt, Is, L.group);
    const int nb1 = Is / 32, nb2 = Hp / kRowBlock;
    const int n_pg = na + na * nb1, n_items = n_pg + na * nb2;
    ExpertSync* es = ns.sync.get();
    int64_t ns_in[kNumPhases] = {};  // this worker's busy time per phase (added once, at the end)
    uint64_t int_items = 0, items = 0;
    bool in_down = false;
    auto wait_for = [&](const std::atomic<int>& flag) {
      if (flag.load(std::memory_order_acquire)) return;
      const int64_t t0 = mono_ns();
      spin_until(flag, 1);
      ns_in[PH_STALL] += mono_ns() - t0;
    };
    auto prep_x = [&](int a) {
      const int64_t t0 = mono_ns();
      rows.resize(count_[a]);
      for (int p = 0; p < count_[a]; ++p) rows[p] = hidden_ + (size_t)pair_token_[first_[a] + p] * H;
      kernels_for(a).prep(rows.data(), H, Hp, count_[a], ns.xprep.data() + ns.x_off[a]);
      es[a].x.store(1, std::memory_order_release);
      ns_in[PH_PREP_X] += mono_ns() - t0;
    };
    auto prep_act = [&](int a) {
      const int64_t t0 = mono_ns();
      rows.resize(count_[a]);
      for (int p = 0; p < count_[a]; ++p) rows[p] = ns.act.data() + (size_t)(first_[a] + p) * Is;
      kernels_for(a).prep(rows.data(), Is, Is, count_[a], ns.aprep.data() + ns.a_off[a]);
      es[a].a.store(1, std::memory_order_release);
      ns_in[PH_PREP_ACT] += mono_ns() - t0;
    };
    auto gate_up = [&](int a, int b) {
      const int e = active_[a], n = count_[a];
      wait_for(es[a].x);
      if (scratch) {
        const int64_t t0 = mono_ns();
        const WeightView w = view_for(
            a,
            {fmt, sh.w13 + e * sh.w13_expert + (size_t)b * 64 * rb13, rb13,
             sh.s13 + e * sh.s13_expert + (size_t)b * 64 * spr13, L.group, L.packed},
            Hp);
        kernels_for(a).gemm(w, kRowBlock, Hp, ns.xprep.data() + ns.x_off[a], n, C, kRowBlock,
                            kscratch);
        ++items;
        int_items += use_int_[a];
        const int64_t t_silu = mono_ns();
        for (int p = 0; p < n; ++p) {
          const float* c = C + (size_t)p * kRowBlock;
          float* dst = ns.act.data() + (size_t)(first_[a] + p) * Is + b * 32;
          if (!plain_act) {
            activate(L.act, e, L.I, sh.i0 + b * 32, c, c + 32, dst, 32);
          } else if (kernels_.silu_mul) {
            kernels_.silu_mul(c, c + 32, dst, 32);
          } else {
            for (int j = 0; j < 32; ++j) dst[j] = c[j] / (1.f + std::exp(-c[j])) * c[32 + j];
          }
        }
        ns_in[PH_SILU] += mono_ns() - t_silu;
        ns_in[PH_GATE_UP] += t_silu - t0;
      }
      // The last of the expert's G items (acq_rel: it sees the others' act rows) preps them.
      if (es[a].gu.fetch_add(1, std::memory_order_acq_rel) + 1 == nb1) prep_act(a);
    };
    auto down = [&](int a, int hb) {
      const int e = active_[a], n = count_[a];
      wait_for(es[a].a);
      if (!scratch) return;
      const int64_t t0 = mono_ns();
      const WeightView w = view_for(
          a,
          {fmt, sh.w2 + e * sh.w2_expert + (size_t)hb * kRowBlock * rb2, rb2,
           sh.s2 + e * sh.s2_expert + (size_t)hb * kRowBlock * spr2, L.group, L.packed},
          Is);
      kernels_for(a).gemm(w, kRowBlock, Is, ns.aprep.data() + ns.a_off[a], n, C, kRowBlock,
                          kscratch);
      ++items;
      int_items += use_int_[a];
      for (int p = 0; p < n; ++p)
        std::memcpy(ns.y.data() + (size_t)pair_slot_[first_[a] + p] * Hp + hb * kRowBlock,
                    C + (size_t)p * kRowBlock, sizeof(float) * kRowBlock);
      ns_in[PH_DOWN] += mono_ns() - t0;
    };
    auto run_item = [&](int i) {
      if (i < na) {
        prep_x(i);
      } else if (i < n_pg) {
        gate_up((i - na) / nb1, (i - na) % nb1);
      } else {
        if (!in_down) {
          in_down = true;
          wall(PH_GATE_UP);
        }
        down((i - n_pg) / nb2, (i - n_pg) % nb2);
      }
    };
    for (int cur = ns.next.load(std::memory_order_relaxed); cur < n_items;) {
      const int take = cur < na ? 1 : std::max(1, (n_items - cur) / (kClaimDiv * nt));
      if (!ns.next.compare_exchange_weak(cur, cur + take, std::memory_order_relaxed)) continue;
      for (int i = cur; i < cur + take; ++i) run_item(i);  // take <= n_items - cur
      cur = ns.next.load(std::memory_order_relaxed);
    }
    if (!in_down) wall(PH_GATE_UP);
    for (int ph = 0; ph < kNumPhases; ++ph)
      if (ns_in[ph]) ph_busy_[ph].fetch_add(ns_in[ph], std::memory_order_relaxed);
    ph_int_items_.fetch_add(int_items, std::memory_order_relaxed);
    ph_float_items_.fetch_add(items - int_items, std::memory_order_relaxed);
  }
  global_barrier_.fetch_add(1);
  spin_until(global_barrier_, workers_->size());
  wall(PH_DOWN);
  // Phase 3: out[t] = sum over nodes and slots of weight * expert output.
  const int k = k_;
  for (int t; (t = reduce_.fetch_add(1)) < T_;) {
    float* o = out_ + (size_t)t * H;
    bool first = true;
    for (size_t n = 0; n < node_state_.size(); ++n) {
      if (L.shards[n].Is == 0) continue;
      const float* y = node_state_[n]->y.data();
      for (int j = 0; j < k; ++j) {
        const int s = t * k + j;
        if (ids_[s] < 0) continue;
        const float wgt = weights_[s];
        const float* yr = y + (size_t)s * Hp;
        if (first) {
          for (int h = 0; h < H; ++h) o[h] = wgt * yr[h];
        } else {
          for (int h = 0; h < H; ++h) o[h] += wgt * yr[h];
        }
        first = false;
      }
    }
    if (first) {
      std::memset(o, 0, sizeof(float) * H);
    } else if (!L.act.b2.empty()) {  // the down bias, once per routed slot (not per node)
      for (int j = 0; j < k; ++j) {
        const int s = t * k + j;
        if (ids_[s] < 0) continue;
        const float wgt = weights_[s];
        const float* b = L.act.b2.data() + (size_t)ids_[s] * H;
        for (int h = 0; h < H; ++h) o[h] += wgt * b[h];
      }
    }
  }
  const int64_t t_end = busy(PH_REDUCE);
  if (timer) ph_wall_[PH_REDUCE].fetch_add(t_end - t_phase, std::memory_order_relaxed);
  // The last worker out closes the call: start of submit -> now.
  if (workers_done_.fetch_add(1) + 1 == (int)workers_->size())
    ph_job_.fetch_add(mono_ns() - t_start_ns_, std::memory_order_relaxed);
}

}  // namespace tandem_cpu
