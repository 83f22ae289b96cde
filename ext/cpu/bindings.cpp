// Thin pybind11 layer over ExpertPool. Tensors arrive as raw addresses: the Python wrapper
// (ext/cpu/pool.py) validates shapes, dtypes, devices and contiguity and keeps the tensors alive.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "isa.h"
#include "moe.h"

namespace py = pybind11;
using tandem_cpu::ExpertPool;

PYBIND11_MODULE(_tandem_cpu, m) {
  m.doc() = "Tandem CPU expert pool (C++17)";
  m.def("supported_isas", &tandem_cpu::supported_isas);
  py::class_<ExpertPool>(m, "ExpertPool")
      .def(py::init<int, const std::string&>(), py::arg("num_threads"), py::arg("isa"),
           py::call_guard<py::gil_scoped_release>())
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
          "dequantize",
          [](ExpertPool& p, int layer, uintptr_t w13, uintptr_t w2) {
            p.dequantize(layer, (float*)w13, (float*)w2);
          },
          py::call_guard<py::gil_scoped_release>())
      .def("has_layer", &ExpertPool::has_layer)
      .def("layer_shape",
           [](const ExpertPool& p, int layer) {
             const auto& L = p.layer(layer);
             return py::make_tuple(L.E, L.I, L.H, L.fmt, L.group);
           })
      .def("layer_bytes", [](const ExpertPool& p, int layer) { return p.layer(layer).weight_bytes(); })
      .def("layer_ids", &ExpertPool::layer_ids)
      .def_property_readonly("isa", &ExpertPool::isa)
      .def_property_readonly("num_threads", [](const ExpertPool& p) { return p.workers().size(); })
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
}
