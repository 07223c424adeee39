// D_i = rowsum(dO_i * o_i), the backward's per-row term of dS = P (dP - D) (SPEC, Backward;
// FlashAttention-2's preprocessing step), from the o the caller passes. Every backward
// kernel family reads D from here; computing it from o instead of from the recomputed
// tiles (sum_j P_ij dP_ij, two extra tile products per tile) cut the backward from 9 tile
// products to 7 (bench/NOTES-gpu.md, v11).
//
// One warp per row of any layout (element strides), the products summed in the
// accumulation type: 16-bit products are exact in float32, so the only rounding is the
// sum's. Memory-bound: it reads dO and o once.
//
// Compile-time configuration (NVRTC -D options): STORAGE (the inputs' storage type), ACCUM
// (float, or double for float64 inputs).
#include "common.cuh"

extern "C" __global__ void attention_backward_delta(const STORAGE* d_out, const STORAGE* o,
                                                    ACCUM* delta, i64 n_rows, int n_heads,
                                                    i64 n_q, int value_dim, i64 do_sb,
                                                    i64 do_sh, i64 do_sn, i64 do_sd, i64 o_sb,
                                                    i64 o_sh, i64 o_sn, i64 o_sd) {
    const int lane = threadIdx.x % 32;
    const i64 warps = static_cast<i64>(gridDim.x) * (blockDim.x / 32);
    for (i64 row = blockIdx.x * static_cast<i64>(blockDim.x / 32) + threadIdx.x / 32;
         row < n_rows; row += warps) {
        // row = (batch * n_heads + head) * n_q + query, delta's own (contiguous) order.
        const i64 query = row % n_q, batch_head = row / n_q;
        const i64 batch = batch_head / n_heads, head = batch_head % n_heads;
        const STORAGE* do_row = d_out + batch * do_sb + head * do_sh + query * do_sn;
        const STORAGE* o_row = o + batch * o_sb + head * o_sh + query * o_sn;
        ACCUM sum = 0;
        for (int d = lane; d < value_dim; d += 32)
            sum += static_cast<ACCUM>(widen(do_row[d * do_sd])) *
                   static_cast<ACCUM>(widen(o_row[d * o_sd]));
        sum = warp_sum(sum);
        if (lane == 0) delta[row] = sum;
    }
}
