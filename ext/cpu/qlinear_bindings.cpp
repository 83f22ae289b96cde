// pybind11 face of QLinearPool (ext/cpu/qlinear.py validates every tensor before its address
// reaches here). Registered from bindings.cpp's module.
#include <pybind11/pybind11.h>

#include "qlinear.h"

namespace py = pybind11;
using tandem_cpu::QLinearArgs;
using tandem_cpu::QLinearPool;

void bind_qlinear(py::module_& m) {
  py::class_<QLinearPool>(m, "QLinearPool")
      .def(py::init<int, const std::string&, bool>(), py::arg("num_threads"), py::arg("isa"),
           py::arg("int8") = true, py::call_guard<py::gil_scoped_release>())
      .def(
          "run",
          [](QLinearPool& p, int qtype, uintptr_t w, size_t row_bytes, int N, int K, uintptr_t x,
             bool x_bf16, int M, uintptr_t y, bool y_bf16) {
            QLinearArgs a;
            a.qtype = qtype;
            a.w = (const uint8_t*)w;
            a.row_bytes = row_bytes;
            a.N = N;
            a.K = K;
            a.M = M;
            a.y = (void*)y;
            a.y_bf16 = y_bf16;
            p.run(a, (const void*)x, x_bf16);
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "run_scaled",
          [](QLinearPool& p, int qtype, uintptr_t w, size_t row_bytes, int N, int K, uintptr_t x,
             bool x_bf16, int M, uintptr_t y, bool y_bf16, uintptr_t scales, uintptr_t zeros,
             int group, int block_rows, int block_cols, int scale_cols) {
            QLinearArgs a;
            a.qtype = qtype;
            a.w = (const uint8_t*)w;
            a.row_bytes = row_bytes;
            a.N = N;
            a.K = K;
            a.M = M;
            a.y = (void*)y;
            a.y_bf16 = y_bf16;
            a.scales = (const void*)scales;
            a.zeros = (const uint8_t*)zeros;
            a.group = group;
            a.block_rows = block_rows;
            a.block_cols = block_cols;
            a.scale_cols = scale_cols;
            p.run(a, (const void*)x, x_bf16);
          },
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("isa", &QLinearPool::isa)
      .def_property_readonly("int8_isa", &QLinearPool::int8_isa)
      .def("int8_serves", &QLinearPool::int8_serves)
      .def_property_readonly("num_threads", &QLinearPool::num_threads);
}
