// Stream-ordered host functions (or flag words) for the expert pool: a CUDA stream (or a graph captured from
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

// Flag jobs: no host function. "" when cuStreamWriteValue32/cuStreamWaitValue32 were found.
std::string cuda_memops_error();
// Enqueue "go: rows" (a 4-byte write of rows + 1 to the job's go word, after a memory barrier)
// and "wait until done == 1, then set done = 0" on `stream`. Capturable in a CUDA graph.
void enqueue_go(uintptr_t stream, StreamJob* job, int rows);
void enqueue_done_wait(uintptr_t stream, StreamJob* job);
// The same two from the host (tests without a GPU): false if done did not come in timeout_s.
void host_go(StreamJob* job, int rows);
bool host_done_wait(StreamJob* job, double timeout_s);

}  // namespace tandem_cpu
