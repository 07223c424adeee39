// D_i = rowsum(dO_i * o_i), the backward's per-row term of dS = P (dP - D) (SPEC, Backward;
// FlashAttention-2's preprocessing step), from the o the caller passes. Every backward
// kernel family reads D from here; computing it from o instead of from the recomputed
// tiles (sum_j P_ij dP_ij, two extra tile products per tile) cut the backward from 9 tile
// products to 7 (bench/NOTES-gpu.md, v11).
//
// The products are summed in the accumulation type: 16-bit products are exact in float32,
// so the only rounding is the sum's. Memory-bound: it reads dO and o once.
//
// * attention_backward_delta_vectors: rows contiguous and 16-byte aligned (the launcher
//   checks), so each lane reads 16 bytes of both rows at a time and a group of lanes (a
//   power of two up to the warp) shares a row. At D = 64 in float16 that is 8 lanes a
//   row, 4 rows a warp: a quarter of the load instructions of one warp per row, which
//   moved 0.84 TB/s (0.16 ms at B16 H32 N1024).
// * attention_backward_delta: any layout (element strides), one warp per row.
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

constexpr int kPerVector = 16 / sizeof(STORAGE);  // elements in 16 bytes

union Vector {
    uint4 bits;
    STORAGE values[kPerVector];
};

// `row_lanes` (a power of two, at most 32) lanes per row; strides in elements, each a
// multiple of kPerVector, the last dimension contiguous.
extern "C" __global__ void attention_backward_delta_vectors(
    const STORAGE* d_out, const STORAGE* o, ACCUM* delta, i64 n_rows, int n_heads, i64 n_q,
    int value_dim, int row_lanes, i64 do_sb, i64 do_sh, i64 do_sn, i64 o_sb, i64 o_sh,
    i64 o_sn) {
    const int group_lane = threadIdx.x % row_lanes;
    const int vectors = value_dim / kPerVector;
    const i64 rows_per_pass = static_cast<i64>(gridDim.x) * blockDim.x / row_lanes;
    // Every lane of the warp runs the same number of passes (n_rows rounded up to whole
    // warps), so the shuffles below always have their whole warp.
    const i64 warp_rows = 32 / row_lanes;
    const i64 rows_padded = (n_rows + warp_rows - 1) / warp_rows * warp_rows;
    for (i64 row = (blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x) / row_lanes;
         row < rows_padded; row += rows_per_pass) {
        ACCUM sum = 0;
        if (row < n_rows) {
            const i64 query = row % n_q, batch_head = row / n_q;
            const i64 batch = batch_head / n_heads, head = batch_head % n_heads;
            const uint4* do_row = reinterpret_cast<const uint4*>(
                d_out + batch * do_sb + head * do_sh + query * do_sn);
            const uint4* o_row =
                reinterpret_cast<const uint4*>(o + batch * o_sb + head * o_sh + query * o_sn);
            for (int vector = group_lane; vector < vectors; vector += row_lanes) {
                Vector a, b;
                a.bits = do_row[vector];
                b.bits = o_row[vector];
#pragma unroll
                for (int e = 0; e < kPerVector; ++e)
                    sum += static_cast<ACCUM>(widen(a.values[e])) *
                           static_cast<ACCUM>(widen(b.values[e]));
            }
        }
        for (int mask = row_lanes / 2; mask > 0; mask >>= 1)
            sum += __shfl_xor_sync(0xffffffffu, sum, mask);
        if (group_lane == 0 && row < n_rows) delta[row] = sum;
    }
}
