// Gradients computed in parts, added in float32 (or double) in a fixed order, so the result
// does not depend on scheduling: out[b, h, n, d] = sum over s of parts[b, h * splits + s,
// n, d]: dK and dV of GQA groups whose query heads were cut over GROUP_SPLITS blocks (the
// dK/dV kernels' GROUP_SPLITS), and dQ of a split-KV grid (SPLIT_KEYS, common.cuh: float32
// parts of each head's key shares). Memory-bound: it reads the parts once and writes out
// once.
//
// Compile-time configuration (NVRTC -D options): STORAGE, ACCUM, PART (the parts' type,
// STORAGE unless given).
#include "common.cuh"

#ifndef PART
#define PART STORAGE
#endif

extern "C" __global__ void group_sum(const PART* parts, STORAGE* out, i64 head_elements,
                                     i64 total, int splits) {
    const i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
    for (i64 e = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; e < total;
         e += stride) {
        const i64 head = e / head_elements, offset = e % head_elements;
        const PART* part = parts + head * splits * head_elements + offset;
        ACCUM sum = 0;
        for (int s = 0; s < splits; ++s)
            sum += static_cast<ACCUM>(widen(part[s * head_elements]));
        out[e] = narrow<STORAGE>(sum);
    }
}
