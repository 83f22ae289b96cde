// Thin pybind11 layer over ExpertPool, LinearPool and the CPU paged attention. Tensors arrive as raw addresses: the Python wrapper
// (ext/cpu/pool.py) validates shapes, dtypes, devices and contiguity and keeps the tensors alive.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "attention.h"
#include "norm.h"
#include "rope.h"
#include "isa.h"
#include "linear.h"
#include "moe.h"
#include "stream.h"

namespace py = pybind11;
using tandem_cpu::ExpertPool;
using tandem_cpu::LinearArgs;
using tandem_cpu::LinearPool;
using tandem_cpu::StreamJob;

void bind_qlinear(py::module_& m);  // qlinear_bindings.cpp

namespace {
// A job handle from Python, checked against the pool that made it.
StreamJob* job_of(const ExpertPool& p, uintptr_t handle) {
  StreamJob* job = reinterpret_cast<StreamJob*>(handle);
  if (!job || job->pool != &p) throw std::invalid_argument("stream job of another pool");
  return job;
}
}  // namespace

PYBIND11_MODULE(_tandem_cpu, m) {
  m.doc() = "Tandem CPU expert pool (C++17)";
  m.def("supported_isas", &tandem_cpu::supported_isas);
#ifdef TANDEM_AMX_EMULATE
  m.attr("amx_emulated") = true;  // "amx" runs tiles in software (ext/cpu/amx_emulate.h)
#else
  m.attr("amx_emulated") = false;
#endif
  m.def("cuda_driver_error", &tandem_cpu::cuda_driver_error);
  m.def("cuda_memops_error", &tandem_cpu::cuda_memops_error);
  m.def("check_layer_file", &tandem_cpu::check_layer_file,
        py::call_guard<py::gil_scoped_release>());
  py::class_<ExpertPool>(m, "ExpertPool")
      .def(py::init<int, const std::string&, int>(), py::arg("num_threads"), py::arg("isa"),
           py::arg("split_nodes") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "add_layer",
          [](ExpertPool& p, int layer, uintptr_t w13, uintptr_t w2, int src_dtype, int E, int I,
             int H, int fmt, int group) {
            p.add_layer(layer, (const void*)w13, (const void*)w2, src_dtype, E, I, H, fmt, group);
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "submit",
          [](ExpertPool& p, int layer, uintptr_t hidden, uintptr_t ids, bool ids_int64,
             uintptr_t weights, uintptr_t out, int T, int k) {
            p.submit(layer, (const float*)hidden, (const void*)ids, ids_int64,
                     (const float*)weights, (float*)out, T, k);
          },
          py::call_guard<py::gil_scoped_release>())
      .def("sync", &ExpertPool::sync, py::call_guard<py::gil_scoped_release>())
      .def(
          "set_expert_act",
          [](ExpertPool& p, int layer, uintptr_t b13, uintptr_t b2, int kind, float alpha,
             float limit) {
            p.set_expert_act(layer, (const float*)b13, (const float*)b2, kind, alpha, limit);
          },
          py::call_guard<py::gil_scoped_release>())
      .def("make_stream_job",
           [](ExpertPool& p, int layer, uintptr_t hidden, uintptr_t ids, uintptr_t weights,
              uintptr_t out, uintptr_t num_tokens, int capacity, int k, uintptr_t flags) {
             return reinterpret_cast<uintptr_t>(p.make_stream_job(
                 layer, (const float*)hidden, (const int64_t*)ids, (const float*)weights,
                 (float*)out, (const int32_t*)num_tokens, capacity, k, (uint32_t*)flags));
           },
           py::arg("layer"), py::arg("hidden"), py::arg("ids"), py::arg("weights"),
           py::arg("out"), py::arg("num_tokens"), py::arg("capacity"), py::arg("k"),
           py::arg("flags") = 0)
      .def(
          "enqueue_go",
          [](ExpertPool& p, uintptr_t stream, uintptr_t job, int rows) {
            tandem_cpu::enqueue_go(stream, job_of(p, job), rows);
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "enqueue_done_wait",
          [](ExpertPool& p, uintptr_t stream, uintptr_t job) {
            tandem_cpu::enqueue_done_wait(stream, job_of(p, job));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "host_go",
          [](ExpertPool& p, uintptr_t job, int rows) { tandem_cpu::host_go(job_of(p, job), rows); })
      .def(
          "host_done_wait",
          [](ExpertPool& p, uintptr_t job, double timeout_s) {
            return tandem_cpu::host_done_wait(job_of(p, job), timeout_s);
          },
          py::call_guard<py::gil_scoped_release>())
      .def("kick", &ExpertPool::kick)
      .def_property("poll_spin_us", &ExpertPool::poll_spin_us, &ExpertPool::set_poll_spin_us)
      .def_property_readonly("flag_jobs_run", &ExpertPool::flag_jobs_run)
      .def(
          "enqueue_submit",
          [](ExpertPool& p, uintptr_t stream, uintptr_t job) {
            tandem_cpu::enqueue_submit(stream, job_of(p, job));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "enqueue_wait",
          [](ExpertPool& p, uintptr_t stream, uintptr_t job) {
            tandem_cpu::enqueue_wait(stream, job_of(p, job));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "run_stream_job",
          [](ExpertPool& p, uintptr_t job) { tandem_cpu::run_inline(job_of(p, job)); },
          py::call_guard<py::gil_scoped_release>())
      .def("stream_stats",
           [](const ExpertPool& p) {
             const auto s = p.stream_stats();
             py::dict d;
             d["calls"] = s.calls;
             d["errors"] = s.errors;
             d["tokens"] = s.tokens;
             d["pool_ns"] = s.pool_ns;
             d["wait_ns"] = s.wait_ns;
             d["d2h_bytes"] = s.d2h_bytes;
             d["h2d_bytes"] = s.h2d_bytes;
             return d;
           })
      .def("last_stream_error", &ExpertPool::last_stream_error)
      .def_property("spin_us", &ExpertPool::spin_us, &ExpertPool::set_spin_us)
      .def(
          "dequantize",
          [](ExpertPool& p, int layer, uintptr_t w13, uintptr_t w2, std::vector<int> experts) {
            p.dequantize(layer, (float*)w13, (float*)w2, experts);
          },
          py::call_guard<py::gil_scoped_release>())
      .def("save_layer", &ExpertPool::save_layer, py::call_guard<py::gil_scoped_release>())
      .def("load_layer", &ExpertPool::load_layer, py::call_guard<py::gil_scoped_release>())
      .def("has_layer", &ExpertPool::has_layer)
      .def("layer_shape",
           [](const ExpertPool& p, int layer) {
             const auto& L = p.layer(layer);
             return py::make_tuple(L.E, L.I, L.H, L.fmt, L.group);
           })
      .def("layer_bytes", [](const ExpertPool& p, int layer) { return p.layer(layer).weight_bytes(); })
      .def("layer_shards",
           [](const ExpertPool& p, int layer) {
             // Each node's shard as one contiguous host region [w13 | w2 | s13 | s2] (the
             // layout of moe.h: Shard) and its geometry; sizes in bytes.
             const auto& L = p.layer(layer);
             py::list out;
             for (const auto& s : L.shards) {
               py::dict d;
               d["ptr"] = reinterpret_cast<uintptr_t>(s.w13);
               d["nbytes"] = s.data_bytes(L.E);
               d["packed"] = L.packed;
               d["i0"] = s.i0;
               d["Is"] = s.Is;
               d["Iv"] = s.Iv;
               d["w13_expert"] = s.w13_expert;
               d["w2_expert"] = s.w2_expert;
               d["s13_expert"] = s.s13_expert * sizeof(float);
               d["s2_expert"] = s.s2_expert * sizeof(float);
               out.append(d);
             }
             return out;
           })
      .def("layer_ids", &ExpertPool::layer_ids)
      .def_property_readonly("isa", &ExpertPool::isa)
      .def_property_readonly("int_isa", &ExpertPool::int_isa)
      .def_property_readonly("int_tiles_from", &ExpertPool::int_tiles_from)
      .def_property("int_min_tokens", &ExpertPool::int_min_tokens,
                    &ExpertPool::set_int_min_tokens)
      .def_property("pack_rows", &ExpertPool::pack_rows, &ExpertPool::set_pack_rows)
      .def("layer_packed", [](const ExpertPool& p, int layer) { return p.layer(layer).packed; })
      .def("reset_phase_stats", &ExpertPool::reset_phase_stats,
           py::call_guard<py::gil_scoped_release>())
      .def("phase_stats",
           [](const ExpertPool& p) {
             static const char* names[tandem_cpu::kNumPhases] = {
                 "wake", "prep_x", "gate_up", "silu", "prep_act", "down", "reduce", "stall"};
             const auto s = p.phase_stats();
             py::dict d, wall, busy;
             for (int i = 0; i < tandem_cpu::kNumPhases; ++i) {
               wall[names[i]] = s.wall_ns[i];
               busy[names[i]] = s.busy_ns[i];
             }
             d["calls"] = s.calls;
             d["tokens"] = s.tokens;
             d["pairs"] = s.pairs;
             d["active_experts"] = s.active_experts;
             d["route_ns"] = s.route_ns;
             d["job_ns"] = s.job_ns;
             d["wall_ns"] = wall;
             d["busy_ns"] = busy;
             d["int_experts"] = s.int_experts;
             d["float_experts"] = s.float_experts;
             d["int_items"] = s.int_items;
             d["float_items"] = s.float_items;
             return d;
           })
      .def_property_readonly("num_threads", [](const ExpertPool& p) { return p.workers().size(); })
      .def_property_readonly("spare_cpus",
                             [](const ExpertPool& p) { return p.workers().spare_cpus(); })
      .def("busy_ns", [](const ExpertPool& p) { return p.workers().busy_ns(); })
      .def_property_readonly("nodes", [](const ExpertPool& p) {
        py::list out;
        for (const auto& n : p.workers().nodes()) {
          py::dict d;
          d["node"] = n.node_id;
          d["cpus"] = n.cpus;
          d["threads"] = n.num_threads;
          out.append(d);
        }
        return out;
      });
  py::class_<LinearPool>(m, "LinearPool")
      .def(py::init<int, const std::string&, int>(), py::arg("num_threads"), py::arg("isa"),
           py::arg("parallel_min_rows") = 1, py::call_guard<py::gil_scoped_release>())
      .def(
          "run",
          [](LinearPool& p, int fmt, uintptr_t w, size_t w_row_bytes, uintptr_t scales, int group,
             int N, int K, int Kp, uintptr_t x, bool x_bf16, int M, uintptr_t bias, uintptr_t y,
             bool y_bf16) {
            LinearArgs a;
            a.fmt = fmt;
            a.w = (const uint8_t*)w;
            a.w_row_bytes = w_row_bytes;
            a.scales = (const float*)scales;
            a.group = group;
            a.N = N;
            a.K = K;
            a.Kp = Kp;
            a.M = M;
            a.bias = (const float*)bias;
            a.y = (void*)y;
            a.y_bf16 = y_bf16;
            p.run(a, (const void*)x, x_bf16);
          },
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("isa", &LinearPool::isa)
      .def_property_readonly("num_threads", &LinearPool::num_threads);
  bind_qlinear(m);
  m.def(
      "rope_neox_bf16",
      [](uintptr_t x, int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride,
         int64_t head_stride, uintptr_t cos, uintptr_t sin) {
        tandem_cpu::rope_neox_bf16((uint16_t*)x, tokens, heads, dim, token_stride, head_stride,
                                   (const uint16_t*)cos, (const uint16_t*)sin);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "rms_norm_bf16",
      [](uintptr_t x, uintptr_t delta, uintptr_t sum, uintptr_t weight, uintptr_t out,
         int64_t rows, int64_t dim, float eps) {
        tandem_cpu::rms_norm_bf16((const uint16_t*)x, (const uint16_t*)delta, (uint16_t*)sum,
                                  (const uint16_t*)weight, (uint16_t*)out, rows, dim, eps);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "paged_attention",
      [](uintptr_t q, uintptr_t out, int64_t num_tokens, uintptr_t k, uintptr_t v, bool kv_bf16,
         int64_t num_blocks, int block_size, int num_heads, int num_kv_heads, int head_dim,
         int num_seqs, uintptr_t q_starts, uintptr_t q_lens, uintptr_t seq_lens,
         uintptr_t block_tables, int max_blocks, float scale, bool q_bf16, int64_t q_row_stride,
         bool out_bf16, uintptr_t k_new, uintptr_t v_new, int64_t k_row_stride,
         int64_t v_row_stride, uintptr_t slots) {
        tandem_cpu::AttentionArgs a;
        a.q = (const void*)q;
        a.q_bf16 = q_bf16;
        a.q_row_stride = q_row_stride;
        a.out = (void*)out;
        a.out_bf16 = out_bf16;
        a.k_new = (const void*)k_new;
        a.v_new = (const void*)v_new;
        a.k_row_stride = k_row_stride;
        a.v_row_stride = v_row_stride;
        a.slots = (const int64_t*)slots;
        a.k = (const void*)k;
        a.v = (const void*)v;
        a.kv_bf16 = kv_bf16;
        a.block_size = block_size;
        a.num_heads = num_heads;
        a.num_kv_heads = num_kv_heads;
        a.head_dim = head_dim;
        a.num_seqs = num_seqs;
        a.q_starts = (const int64_t*)q_starts;
        a.q_lens = (const int64_t*)q_lens;
        a.seq_lens = (const int64_t*)seq_lens;
        a.block_tables = (const int32_t*)block_tables;
        a.max_blocks = max_blocks;
        a.scale = scale;
        tandem_cpu::paged_attention_cpu(a, num_tokens, num_blocks);
      },
      py::call_guard<py::gil_scoped_release>());
}
