/*
 * DFlash2Selector CUDA launcher: one kernel launch per call, one thread block per batch
 * element, the greedy walk sequential in s inside the block.
 */
#ifndef DFLASH2_SELECTOR_KERNEL_H
#define DFLASH2_SELECTOR_KERNEL_H

#include <cuda_runtime_api.h>

#include "dflash2SelectorMath.h"

namespace dflash2
{

//! Launches the selector on `stream` with device pointers in `args`. Arguments must already
//! satisfy dflash2_check_select_args. Returns the launch status (cudaSuccess when B*S == 0).
cudaError_t launchSelectPath(Df2SelectArgs const& args, cudaStream_t stream);

} // namespace dflash2

#endif // DFLASH2_SELECTOR_KERNEL_H
