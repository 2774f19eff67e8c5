// tools/neighbour_kernel.h: a stand-in for the engine's kernel just before a decode call, for
// `cpidx bench --neighbour-us`. The decode kernels ask the SMs for the largest shared-memory
// carveout (prefer_max_shared); an engine's kernels ask what they like, and a split changes only
// on an idle SM. This kernel holds shared memory under the driver's own choice of carveout, so
// the bench shows what a decode call pays behind such a kernel.
#pragma once

#include <cuda_runtime.h>

namespace cpidx::tools {

struct Neighbour {
  double us = 0;             // how long each CTA spins (0: no neighbour kernel)
  int smem_kb = 100;         // dynamic shared memory a CTA holds
  int ctas_per_sm = 1;       // CTAs launched per SM
  bool early_launch = true;  // lets the next kernel launch at its start (PDL's trigger)
};

// Raises the kernel's shared-memory cap to `n`'s (before capturing its launches); its carveout
// preference is left unset.
cudaError_t prepare_neighbour(const Neighbour& n);
// One launch of the neighbour kernel on `stream`, over `sms` SMs (capturable).
cudaError_t launch_neighbour(const Neighbour& n, int sms, cudaStream_t stream);

}  // namespace cpidx::tools
