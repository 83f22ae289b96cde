// The CPU expert pool: converted expert weights (one shard per NUMA node, split along the
// intermediate dimension) and the fused MoE step (gate/up, SiLU*up, down, weighted sum).
// Plain C++: pointers and sizes in, no Python and no torch. Callers keep the buffers alive and
// unchanged from submit() until sync() returns.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels.h"
#include "moe_act.h"
#include "workers.h"

namespace tandem_cpu {

enum SrcDtype : int { SRC_F32 = 0, SRC_BF16 = 1, SRC_F16 = 2 };

class ExpertPool;

// One layer's stream-ordered MoE call: fixed host buffers (pinned by the caller) that a stream
// fills before the submit host function runs and reads after the wait host function returns.
// `num_tokens` points at host memory the stream writes too, so one descriptor serves every
// token count up to `capacity` (every graph bucket and every eager step).
struct StreamJob {
  ExpertPool* pool = nullptr;  // null once the pool is gone: the host functions do nothing
  int layer = 0, capacity = 0, k = 0, H = 0;
  const float* hidden = nullptr;     // [capacity, H]
  const int64_t* ids = nullptr;      // [capacity, k], -1 = skipped slot
  const float* weights = nullptr;    // [capacity, k]
  float* out = nullptr;              // [capacity, H]
  const int32_t* num_tokens = nullptr;  // rows of this call, read when the submit runs
  int tokens = 0;                    // rows of the call in flight (submit -> wait)
  int64_t t_submit_ns = 0;
  // Flag-synchronized jobs (no host functions): the stream writes `*go = rows + 1` after its
  // copies, the pool's poller thread runs the job and writes `*done = 1`, the stream waits for
  // done == 1 and writes it back to 0. Both words sit in pinned, device-mapped host memory
  // (different cache lines); null for host-function jobs.
  uint32_t* go = nullptr;
  uint32_t* done = nullptr;
  uint64_t go_dev = 0, done_dev = 0;  // their device addresses, resolved at the first enqueue
};

struct StreamStats {
  uint64_t calls = 0, errors = 0, tokens = 0;
  uint64_t pool_ns = 0;  // submit host function -> job done, summed
  uint64_t wait_ns = 0;  // time the wait host function blocked the stream, summed
  uint64_t d2h_bytes = 0, h2d_bytes = 0;
};

// Where submit's time goes, summed over calls since the last reset. Always on: a few clock reads
// per worker and work item. The work items of a node run as one stream (run_step): each expert's
// token prep, gate/up, activation prep and down wait only for that expert's own inputs, so the
// preps overlap other experts' weight reads. busy: summed over workers, work only; PH_SILU is
// SiLU(gate) * up inside PH_GATE_UP, PH_STALL the time workers spun waiting for an expert's
// inputs. wall: worker 0's view: PH_WAKE is submit's start_job -> worker 0 running, PH_GATE_UP
// from then to its first down item (token preps, gate/up and activation preps), PH_DOWN from
// there to the end of every node's down items, PH_REDUCE the weighted sum; the other walls stay 0.
enum Phase : int {
  PH_WAKE = 0,
  PH_PREP_X,    // hidden rows -> each kernel's activation layout
  PH_GATE_UP,   // gate and up projections (+ SiLU * up)
  PH_SILU,
  PH_PREP_ACT,  // intermediate activations -> kernel layout
  PH_DOWN,      // down projection
  PH_REDUCE,    // weighted sum over slots (and nodes)
  PH_STALL,     // waiting for an expert's prepared inputs
  kNumPhases
};

struct PhaseStats {
  uint64_t calls = 0, tokens = 0, pairs = 0, active_experts = 0;
  uint64_t route_ns = 0;  // submit on the caller: check ids, group pairs by expert, size buffers
  uint64_t job_ns = 0;    // submit's start -> the last worker done
  uint64_t wall_ns[kNumPhases] = {}, busy_ns[kNumPhases] = {};
  // Per path: (expert, node) pairs of each call, and gemm work items (both projections).
  uint64_t int_experts = 0, float_experts = 0, int_items = 0, float_items = 0;
};

struct Shard {  // one node's slice [i0, i0 + Is) of every expert's intermediate dimension
  int i0 = 0, Is = 0, Iv = 0;  // Is padded to kKAlign; Iv = real (unpadded) columns
  uint8_t* w13 = nullptr;      // [E][Is/32 blocks][32 gate rows + 32 up rows][row_bytes(Hp)]
  float* s13 = nullptr;        // [E][2 * Is][scales_per_row(Hp)]
  uint8_t* w2 = nullptr;       // [E][Hp rows][row_bytes(Is)]
  float* s2 = nullptr;         // [E][Hp][scales_per_row(Is)]
  size_t w13_expert = 0, s13_expert = 0, w2_expert = 0, s2_expert = 0;  // bytes / floats
  size_t mapped_bytes = 0;  // of `mapping` (a loaded file's: its header too)
  // The region [w13 | w2 | s13 | s2] of E experts, in bytes.
  size_t data_bytes(int E) const {
    return (size_t)E * (w13_expert + w2_expert) +
           (size_t)E * (s13_expert + s2_expert) * sizeof(float);
  }
  void* mapping = nullptr;
};

struct Layer {
  int E = 0, H = 0, I = 0, Hp = 0, fmt = FMT_BF16, group = 64;
  bool packed = false;  // int8/int4 rows (w13 and w2) in the packed order (kernels.h)
  std::vector<Shard> shards;  // one per node of the pool
  ExpertAct act;  // set_expert_act; not part of the converted layout nor of a layer file
  ~Layer();
  size_t weight_bytes() const;  // converted weights + scales, all shards
};

// Version of the converted layout that save_layer writes; bump when Shard's layout changes.
// 2: the header records whether int rows are packed (kernels.h: packed_at).
// 3: the header carries a checksum of sampled data lines (a file whose data was overwritten or
//    zeroed after its header was written no longer loads).
constexpr uint32_t kLayoutVersion = 3;

// The header checks of ExpertPool::load_layer (expected values, layout, file size, the sampled
// data lines' checksum) without mapping or reading all the weights: a cheap "would load_layer
// accept this file?". Throws invalid_argument naming the mismatch.
void check_layer_file(const std::string& path, bool check_key, const std::string& key, int E,
                      int I, int H, int fmt, int group);

class ExpertPool {
 public:
  // split_nodes > 0 (tests): pretend the cpus form that many NUMA nodes (see Workers).
  ExpertPool(int num_threads, const std::string& isa, int split_nodes = 0);
  ~ExpertPool();

  // w13 [E, 2I, H] and w2 [E, H, I], contiguous, of src_dtype. Blocks until converted.
  void add_layer(int layer, const void* w13, const void* w2, int src_dtype, int E, int I, int H,
                 int fmt, int group);
  // hidden [T, H] fp32, ids [T, k] int32/int64 (-1 = skip), weights [T, k] fp32, out [T, H].
  // Waits for the previous call, routes, starts the workers and returns.
  void submit(int layer, const float* hidden, const void* ids, bool ids_int64,
              const float* weights, float* out, int T, int k);
  void sync();  // waits for the last submit; throws runtime_error if it failed
  // The layer's activation (ActKind; alpha and limit for the clamped SwiGLU) and per-expert
  // biases: b13 [E, 2I] gate then up, b2 [E, H], fp32, each may be null (none). Copied; kept
  // until the layer is replaced (add_layer / load_layer reset it to bias-free SiLU).
  void set_expert_act(int layer, const float* b13, const float* b2, int kind, float alpha,
                      float limit);
  // Writes the weights as the kernels see them (dequantized, unpadded) into fp32 buffers:
  // every expert, or experts[j] into slot j.
  void dequantize(int layer, float* w13, float* w2, const std::vector<int>& experts);
  // Writes the layer's converted weights to `path`: a 4 KiB header (shapes, format, `key`,
  // checksum), then the one-node layout whatever this pool's node split (node shards are
  // slices of it along I). Not atomic: the caller writes a temporary file and renames it.
  void save_layer(int layer, const std::string& path, const std::string& key);
  // Installs a file written by save_layer as `layer`, without converting. Checks the header
  // against the expected values (E/I/H/fmt/group < 0 and check_key false: not checked) and the
  // file size; throws invalid_argument naming the mismatch. One node: the file is mapped
  // read-only and paged in lazily (the page cache is shared between processes). Several: each
  // node's workers copy their shard out of the mapping into pages they touch first.
  void load_layer(int layer, const std::string& path, bool check_key, const std::string& key,
                  int E, int I, int H, int fmt, int group);

  // -- stream-ordered jobs (ext/cpu/stream.cpp): a CUDA stream runs submit and wait as host
  // functions, so the pool can sit inside a captured CUDA graph.
  // A fixed descriptor over fixed buffers; the pool owns it, it is never freed while the pool
  // lives (graphs keep its address) and is detached, not freed, when the pool goes.
  // flags (may be null): two words 64 bytes apart in pinned host memory, for a flag job; the
  // pool's poller thread starts with the first one.
  StreamJob* make_stream_job(int layer, const float* hidden, const int64_t* ids,
                             const float* weights, float* out, const int32_t* num_tokens,
                             int capacity, int k, uint32_t* flags = nullptr);
  // The two host functions' bodies. Never throw: a failure zeroes the job's output rows and is
  // counted (stream_stats().errors, last_stream_error()).
  void stream_submit(StreamJob& job) noexcept;  // rows from *job.num_tokens
  void stream_start(StreamJob& job, int rows) noexcept;
  void stream_wait(StreamJob& job) noexcept;
  // The poller of flag jobs spins for poll_spin_us after its last job (or kick()) before it
  // naps 50 us between looks; a decode step's next layer then finds it awake.
  void set_poll_spin_us(int us) { poll_spin_us_.store(us < 0 ? 0 : us); }
  int poll_spin_us() const { return poll_spin_us_.load(); }
  void kick() noexcept;  // work is coming: spin again
  uint64_t flag_jobs_run() const { return flag_runs_.load(); }
  StreamStats stream_stats() const;
  std::string last_stream_error() const;
  void set_spin_us(int us) { workers_->set_spin_us(us); }
  int spin_us() const { return workers_->spin_us(); }

  std::string isa() const { return kernels_.name; }
  // The integer path (kernels.h: kQBlock) for int8/int4 layers: "vnni", "amx-int8" or "" (none).
  std::string int_isa() const { return ikernels_.name ? ikernels_.name : ""; }
  // Experts of an int8/int4 layer with at least this many tokens in a call take the integer
  // path; 0: never. Default kAmxIntMinTokens (AMX) or kVnniMinTokens (VNNI) where the CPU has
  // the path, else 0. Between calls.
  void set_int_min_tokens(int n);
  int int_min_tokens() const { return int_min_tokens_; }
  // Tokens of one expert from which the integer path multiplies in AMX tiles; 0: no tiles.
  int int_tiles_from() const { return ikernels_.tiles_from; }
  // Whether layers converted from now on store int8/int4 rows packed (kernels.h: packed_at):
  // default where the CPU has the integer path, whose 1-token kernel reads them in place.
  // Paths that want natural rows unpack a work item's rows first. Loaded layers keep the
  // layout their file has.
  void set_pack_rows(bool on) { pack_rows_ = on; }
  bool pack_rows() const { return pack_rows_; }
  PhaseStats phase_stats() const;
  void reset_phase_stats();
  const Workers& workers() const { return *workers_; }
  bool has_layer(int layer) const { return layers_.count(layer) > 0; }
  const Layer& layer(int layer) const;
  std::vector<int> layer_ids() const;

 private:
  // Readiness of one active expert's data on one node (its own cache line).
  struct alignas(64) ExpertSync {
    std::atomic<int> x{0};   // 1: its tokens are prepared (xprep)
    std::atomic<int> gu{0};  // gate/up work items done
    std::atomic<int> a{0};   // 1: its activations are prepared (aprep)
  };
  struct NodeState {
    std::atomic<int> next{0};  // the node's next work item (run_step: item order)
    std::unique_ptr<ExpertSync[]> sync;
    int sync_size = 0;
    std::vector<size_t> x_off, a_off;  // per active expert, bytes into xprep / aprep
    std::vector<uint8_t> xprep, aprep;
    std::vector<float> act;            // [routed pairs][Is] SiLU(gate) * up
    std::vector<float> y;              // [T * k][Hp] expert outputs per (token, slot)
  };

  std::unique_ptr<Layer> plan_layer(int E, int I, int H, int fmt, int group, bool packed) const;
  void run_step(int worker);
  void run_convert(int worker, Layer* L, const void* w13, const void* w2, int src_dtype,
                   std::atomic<int>* counters);
  uint8_t* scratch_for(int worker, size_t bytes);

  std::unique_ptr<Workers> workers_;
  KernelSet kernels_;
  std::map<int, std::unique_ptr<Layer>> layers_;
  std::vector<std::vector<uint8_t>> scratch_;  // per worker, grown (first touched) by the worker
  std::vector<char> scratch_failed_;

  // The call in flight (valid from submit to the end of the job).
  Layer* L_ = nullptr;
  const float* hidden_ = nullptr;
  const float* weights_ = nullptr;
  float* out_ = nullptr;
  int T_ = 0, k_ = 0;
  std::vector<int> ids_;         // [T * k], -1 = skipped
  std::vector<int> active_;      // experts with >= 1 token
  std::vector<int> count_, first_;  // per active expert: routed pairs, offset into pair lists
  std::vector<int> pair_token_, pair_slot_;  // grouped by expert
  std::vector<int> expert_slot_;  // scratch: active index of each expert
  std::vector<char> use_int_;     // per active expert: the integer path
  KernelSet ikernels_{};          // the integer path; name null: none
  KernelSet ikernels8_{};         // and for packed int8 rows (AMX: 16-bit activations)
  KernelSet ikernels4g_{};        // and for int4 in groups of kTileQBlock4 (AMX: 64-blocks)
  int int_min_tokens_ = 0;
  bool pack_rows_ = false;
  // Packed rows [0, R) -> natural rows (vnni_unpack_rows where the CPU has it).
  void (*unpack_rows_)(const WeightView& w, int R, int K, uint8_t* dst) = nullptr;
  const KernelSet& kernels_for(int a) const {
    return !use_int_[a]                                ? kernels_
           : L_->fmt == FMT_INT8 && L_->packed      ? ikernels8_
           : L_->fmt == FMT_INT4 && L_->group == kTileQBlock4 ? ikernels4g_
                                                     : ikernels_;
  }
  int64_t t_start_ns_ = 0;        // submit's start (job_ns)
  std::atomic<int> workers_done_{0};
  std::atomic<uint64_t> ph_calls_{0}, ph_tokens_{0}, ph_pairs_{0}, ph_active_{0}, ph_route_{0},
      ph_job_{0}, ph_int_experts_{0}, ph_float_experts_{0}, ph_int_items_{0}, ph_float_items_{0};
  std::atomic<uint64_t> ph_wall_[kNumPhases] = {}, ph_busy_[kNumPhases] = {};
  int64_t t_wake_ns_ = 0;         // submit's start_job (PH_WAKE)
  int max_count_ = 0;
  std::vector<std::unique_ptr<NodeState>> node_state_;
  std::atomic<int> reduce_{0}, global_barrier_{0};
  std::atomic<bool> failed_{false};

  std::vector<StreamJob*> stream_jobs_;  // leaked on purpose: a graph may outlive the pool
  std::atomic<uint64_t> s_calls_{0}, s_errors_{0}, s_tokens_{0}, s_pool_ns_{0}, s_wait_ns_{0},
      s_d2h_{0}, s_h2d_{0};
  mutable std::mutex stream_mu_;  // guards stream_jobs_ and last_error_
  std::string last_error_;
  void stream_error(StreamJob& job, const char* what) noexcept;

  // Flag jobs and their poller (ext/cpu/stream.cpp). The array only grows; readers take the
  // count with acquire, writers publish the pointer before the count.
  static constexpr int kMaxFlagJobs = 4096;
  std::unique_ptr<StreamJob*[]> flag_jobs_{new StreamJob*[kMaxFlagJobs]()};
  std::atomic<int> num_flag_jobs_{0};
  std::thread poller_;
  std::atomic<bool> poller_stop_{false};
  std::atomic<int> poll_spin_us_{20000};
  std::atomic<int64_t> kick_ns_{0};
  std::atomic<uint64_t> flag_runs_{0};
  void poll_loop() noexcept;
  void stop_poller() noexcept;
};

}  // namespace tandem_cpu
