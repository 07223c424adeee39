// Gradients computed in parts, added in float32 (or double) in a fixed order, so the result
// does not depend on scheduling: out[b, h, n, d] = sum over s of parts[b, h * splits + s,
// n, d]: dK and dV of GQA groups whose query heads were cut over GROUP_SPLITS blocks (the
// dK/dV kernels' GROUP_SPLITS), and dQ of a split-KV grid (SPLIT_KEYS, common.cuh: float32
// parts of each head's key shares). Memory-bound: it reads the parts once and writes out
// once.
//
// Compile-time configuration (NVRTC -D options): STORAGE, ACCUM, PART (the parts' type,
// STORAGE unless given), STRIDED_OUT (0/1, default 0): `out` at the row and head strides
// given (a "bshd" gradient, rows H x D apart), else contiguous (B, H, N, D); the
// launcher passes the shape and strides either way.
#include "common.cuh"

#ifndef PART
#define PART STORAGE
#endif
#ifndef STRIDED_OUT
#define STRIDED_OUT 0
#endif

extern "C" __global__ void group_sum(const PART* parts, STORAGE* out, i64 head_elements,
                                     i64 total, int splits, int n_heads, int width,
                                     i64 out_sb, i64 out_sh, i64 out_sn) {
    const i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
    for (i64 e = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; e < total;
         e += stride) {
        const i64 head = e / head_elements, offset = e % head_elements;
        const PART* part = parts + head * splits * head_elements + offset;
        ACCUM sum = 0;
        for (int s = 0; s < splits; ++s)
            sum += static_cast<ACCUM>(widen(part[s * head_elements]));
        if (STRIDED_OUT) {
            const i64 row = offset / width;
            out[head / n_heads * out_sb + head % n_heads * out_sh + row * out_sn +
                (offset - row * width)] = narrow<STORAGE>(sum);
        } else {
            out[e] = narrow<STORAGE>(sum);
        }
    }
}
