/*
 * DFlash2Selector C ABI: the CPU twin (libdflash2_selector_cpu.so and libdflash2_plugins.so)
 * and, in libdflash2_plugins.so only, a host-pointer entry to the CUDA kernel for tests.
 * Both return 0 on success, else non-zero with a message in `err` (NUL-terminated, truncated
 * to errLen). Loadable with ctypes; the CPU library needs neither TensorRT nor CUDA.
 */
#ifndef DFLASH2_SELECTOR_CPU_H
#define DFLASH2_SELECTOR_CPU_H

#include <stddef.h>

#include "dflash2SelectorMath.h"

#if defined(_WIN32)
#define DF2_API __declspec(dllexport)
#else
#define DF2_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Version of Df2SelectArgs / these entry points; bump on any layout change. */
DF2_API int32_t dflash2_selector_abi_version(void);

/* Checks sizes, limits, dtype codes, attribute values and pointers (not id ranges). */
DF2_API int32_t dflash2_check_select_args(Df2SelectArgs const* args, char* err, size_t errLen);

/* The op on the CPU with the kernel's exact arithmetic (ids outside [0, V) give -inf scores). */
DF2_API int32_t dflash2_select_path_cpu(Df2SelectArgs const* args, char* err, size_t errLen);

/* libdflash2_plugins.so / libdflash2_kernel.so: copies host buffers to the GPU, runs the kernel once, copies the
   outputs back. timingIters > 0 then times that many launches and writes microseconds per
   launch to *usPerCall. For tests and benchmarks, not for production. */
DF2_API int32_t dflash2_select_path_cuda(
    Df2SelectArgs const* args, int32_t timingIters, float* usPerCall, char* err, size_t errLen);

/* libdflash2_plugins.so / libdflash2_kernel.so: one kernel launch on `stream` (a cudaStream_t; NULL: the
   legacy default stream), every pointer in `args` a DEVICE pointer; no copy, no synchronisation, so it
   can be captured into a CUDA graph. Returns the launch status (0, or 1 with the CUDA error in `err`). */
DF2_API int32_t dflash2_launch_select_path(Df2SelectArgs const* args, void* stream, char* err, size_t errLen);

/* libdflash2_plugins.so / libdflash2_kernel.so: number of visible CUDA devices, or -1 with the CUDA error in `err`
   (no driver, no device). Lets tests skip with the real reason. */
DF2_API int32_t dflash2_cuda_device_count(char* err, size_t errLen);

#ifdef __cplusplus
}
#endif

#endif // DFLASH2_SELECTOR_CPU_H
