// Stream-ordered host functions for the expert pool: a CUDA stream (or a graph captured from
// it) runs "start this job" and "block until it is done" as host nodes, so the pool needs no
// host wait in the caller and fits inside a captured CUDA graph. The CUDA driver is resolved at
// run time (dlopen libcuda.so.1): the library builds and loads on machines without CUDA.
#pragma once

#include <cstdint>
#include <string>

#include "moe.h"

namespace tandem_cpu {

// "" when cuLaunchHostFunc was found; else why not (no libcuda, no symbol).
std::string cuda_driver_error();
// Enqueue job's submit / wait host function on `stream` (a CUstream / cudaStream_t; 0 is the
// legacy default stream). Throw runtime_error if the driver is missing or refuses the launch.
void enqueue_submit(uintptr_t stream, StreamJob* job);
void enqueue_wait(uintptr_t stream, StreamJob* job);
// Runs both host functions on the calling thread, in stream order (tests, CPU-only machines).
void run_inline(StreamJob* job);

}  // namespace tandem_cpu
