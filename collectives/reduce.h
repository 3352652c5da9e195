// Reduction kernels: dst[i] = a[i] op b[i] (dst may alias a or b). Vectorized loops; large
// ranges are split across `threads` OpenMP threads. bfloat16 is computed in float32 and
// rounded back (round to nearest even) at each step. RedOp::kAvg reduces like kSum; divide
// at the end with scale_avg().
#pragma once

#include <cstddef>

#include "collectives/types.h"

namespace qring::collectives {

void reduce(void* dst, const void* a, const void* b, size_t count, DataType type, RedOp op,
            int threads = 1);
// dst[i] /= divisor (integer types: truncating division), on the calling thread.
void scale_avg(void* dst, size_t count, DataType type, int divisor);

}  // namespace qring::collectives
