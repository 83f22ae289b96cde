// Helpers the pool's translation units share (moe.cpp, moe_convert.cpp, moe_file.cpp,
// moe_step.cpp): shard geometry and placement, row conversion, clocks. Not part of the pool's API.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "moe.h"

namespace tandem_cpu {
namespace moe_impl {

inline size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

inline int64_t mono_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// count elements of a source tensor (SrcDtype) from element offset `at`, as floats.
void load_src(const void* base, int dtype, size_t at, int count, float* dst);
// One row of K floats into the converted layout (ext/cpu/reference.py::quantize), in the packed
// order when `packed` (int8/int4). int8: amax < 0 means "the row's own absolute maximum".
void convert_row(int fmt, int group, bool packed, const float* x, int K, uint8_t* dst,
                 float* scales, float amax = -1.f);
// Rows [0, R) of w (packed int8/int4), natural, one at a time: where the CPU has no
// vnni_unpack_rows (a layer file packed elsewhere).
void unpack_rows_portable(const WeightView& w, int R, int K, uint8_t* dst);
// A layer's sizes, with no shards and nothing allocated; throws invalid_argument when bad.
std::unique_ptr<Layer> layer_geometry(int E, int I, int H, int fmt, int group);
// The geometry of a node's shard [i0, i0 + Is) of L (sizes only, no memory).
Shard plan_shard(const Layer& L, int i0, int Is);
// Points the shard's arrays into `base`: [w13 of every expert][w2][s13][s2].
void place_shard(Shard& s, int E, uint8_t* base);
// Untouched anonymous pages for a shard; whoever writes them first places them on its node.
void alloc_shard(Shard& s, int E);

}  // namespace moe_impl
}  // namespace tandem_cpu
