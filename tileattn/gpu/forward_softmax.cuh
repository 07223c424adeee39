// The element-wise half of the tensor-core forwards (attention_mma_forward.cu with
// mma.sync, attention_wgmma_forward.cu with wgmma), shared because both hold a warp's
// scores in the same registers: the m16n8 accumulator layout, thread (quad_row, quad_col)
// of a warp owning rows quad_row and quad_row + 8 of each 16-row tile m and columns
// 8 n + 2 quad_col + {0, 1} of each 8-key fragment n. Arrays are indexed [m][n][e]: e = 0, 1
// the first row, e = 2, 3 the second.
//
// Scores become logits in kLogitUnit units (mma.cuh: base 2 for 16-bit inputs, scale *
// log2(e) folded into one multiply; natural for float32) and the online softmax
// (FlashAttention-2 section 3.1.1) runs on ex2.approx; the four threads of
// a quad share a row, so row maxima take two shuffles and row sums stay per-thread partial
// sums until the end (the rescale is quad-uniform).
#pragma once
#include "kept_products.cuh"
#include "mma.cuh"

constexpr float kLn2 = 0.6931471805599453f;

// The run-time score options, pre-multiplied into logit units (kLogitUnit), in the
// accumulators' type Real (float; double for the float64 forward: every function below
// takes either).
template <typename Real> struct ForwardScoresOf {
    Real logit_scale;         // scale * kLogitUnit
    Real scale_over_softcap;  // scale / softcap
    Real logit_softcap;       // softcap * kLogitUnit
    Real logit_slope;         // this head's ALiBi slope * kLogitUnit
    Band band;
    i64 n_k;
};
using ForwardScores = ForwardScoresOf<float>;

template <typename Real>
__device__ __forceinline__ ForwardScoresOf<Real> make_forward_scores(Real scale, Real softcap,
                                                                     const double* slopes,
                                                                     i64 bh, Band band,
                                                                     i64 n_k) {
    ForwardScoresOf<Real> scores;
    set_logit_factors(scores, scale, softcap, slopes, bh);
    scores.band = band;
    scores.n_k = n_k;
    return scores;
}

// Whether the key tile [col_start, col_start + block_k) against query rows
// [row_start, row_start + block_q) needs the per-score mask: it straddles the end of the
// keys or an edge of the band. Tiles wholly inside skip it.
template <typename Real>
__device__ __forceinline__ bool key_tile_needs_mask(const ForwardScoresOf<Real>& scores,
                                                    i64 row_start, int block_q, i64 col_start,
                                                    int block_k) {
    bool needs_mask = col_start + block_k > scores.n_k;
    if (LIMIT_RIGHT)
        needs_mask = needs_mask ||
                     col_start + block_k - 1 > row_start + scores.band.offset + scores.band.right;
    if (LIMIT_LEFT)
        needs_mask = needs_mask ||
                     col_start < row_start + block_q - 1 + scores.band.offset - scores.band.left;
    return needs_mask;
}

// Raw products Q K^T -> logits: scale, softcap, ALiBi (row m, half h of this thread
// taking slope slopes[m][h], in logit units), then, when `needs_mask`, the mask (relative
// to the tile at row mask.row0, key col_start) by select. The decode kernel's packed rows
// belong to different query heads, so each row has its own slope.
template <typename Real, int RowTiles, int KeyFrags>
__device__ __forceinline__ void scores_to_logits(Real (&s)[RowTiles][KeyFrags][4],
                                                 const i64 (&rows)[RowTiles][2], i64 col_start,
                                                 bool needs_mask, const TileMask& mask,
                                                 const ForwardScoresOf<Real>& scores,
                                                 const Real (&slopes)[RowTiles][2]) {
    const int quad_col = threadIdx.x % 4;
#pragma unroll
    for (int m = 0; m < RowTiles; ++m) {
        // This thread's columns are n * 8 + (e & 1) past 2 * quad_col.
        const Window kept[2] = {
            mask.row_window(static_cast<int>(rows[m][0] - mask.row0), 2 * quad_col),
            mask.row_window(static_cast<int>(rows[m][1] - mask.row0), 2 * quad_col)};
        // ALiBi's |row + offset - col| as the float `base - (n * 8 + (e & 1))`, base taken
        // once per row: a float add per score instead of 64-bit integer arithmetic and an
        // int64-to-float conversion, the same value while distances stay below 2^24.
        Real base[2] = {Real(0), Real(0)};
        if (ALIBI) {
#pragma unroll
            for (int half = 0; half < 2; ++half)
                base[half] = static_cast<Real>(rows[m][half] + scores.band.offset - col_start -
                                               2 * quad_col);
        }
#pragma unroll
        for (int n = 0; n < KeyFrags; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                Real score;
                if (SOFTCAP)
                    score = scores.logit_softcap * tanh_acc(s[m][n][e] * scores.scale_over_softcap);
                else
                    score = s[m][n][e] * scores.logit_scale;
                if (ALIBI)
                    score -= slopes[m][e >> 1] *
                             abs_acc(base[e >> 1] - static_cast<Real>(n * 8 + (e & 1)));
                if (needs_mask && !kept[e >> 1].keeps(n * 8 + (e & 1)))
                    score = negative_infinity<Real>();
                s[m][n][e] = score;
            }
    }
}

// The same for a block of one query head (the prefill kernels): every row takes the
// head's slope.
template <typename Real, int RowTiles, int KeyFrags>
__device__ __forceinline__ void scores_to_logits(Real (&s)[RowTiles][KeyFrags][4],
                                                 const i64 (&rows)[RowTiles][2], i64 col_start,
                                                 bool needs_mask, const TileMask& mask,
                                                 const ForwardScoresOf<Real>& scores) {
    Real slopes[RowTiles][2];
#pragma unroll
    for (int m = 0; m < RowTiles; ++m) slopes[m][0] = slopes[m][1] = scores.logit_slope;
    scores_to_logits(s, rows, col_start, needs_mask, mask, scores, slopes);
}

// Before the first key tile: O = 0, running max -inf (in logit units), running sums 0.
template <typename Real, int RowTiles, int OutFrags>
__device__ __forceinline__ void start_online_softmax(Real (&o_acc)[RowTiles][OutFrags][4],
                                                     Real (&row_max)[RowTiles][2],
                                                     Real (&row_sum)[RowTiles][2]) {
#pragma unroll
    for (int m = 0; m < RowTiles; ++m) {
#pragma unroll
        for (int n = 0; n < OutFrags; ++n)
            o_acc[m][n][0] = o_acc[m][n][1] = o_acc[m][n][2] = o_acc[m][n][3] = Real(0);
        row_max[m][0] = row_max[m][1] = negative_infinity<Real>();
        row_sum[m][0] = row_sum[m][1] = Real(0);
    }
}

// Dropout's hash state of each of this thread's rows (0, unused, without dropout).
template <int RowTiles>
__device__ __forceinline__ void dropout_row_states(u32 (&states)[RowTiles][2], u32 key, i64 bh,
                                                   const i64 (&rows)[RowTiles][2], u32 row0) {
#pragma unroll
    for (int m = 0; m < RowTiles; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half)
            states[m][half] = DROPOUT ? dropout_row_state(key, static_cast<u32>(bh),
                                                          static_cast<u32>(rows[m][half]) + row0)
                                      : 0u;
}

// One online-softmax step without touching O: logits -> unnormalised probabilities in
// place, the running max and partial sums updated, and `rescale` = e^(old max - new max),
// the factor O still has to take (the wgmma forward applies it once the previous tile's
// P V product, which is still running while this executes, has landed in O).
template <typename Real, int RowTiles, int KeyFrags>
__device__ __forceinline__ void softmax_probabilities(Real (&s)[RowTiles][KeyFrags][4],
                                                      Real (&row_max)[RowTiles][2],
                                                      Real (&row_sum)[RowTiles][2],
                                                      Real (&rescale)[RowTiles][2]) {
#pragma unroll
    for (int m = 0; m < RowTiles; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            Real tile_max = negative_infinity<Real>();
#pragma unroll
            for (int n = 0; n < KeyFrags; ++n)
                tile_max = max_acc(tile_max, max_acc(s[m][n][2 * half], s[m][n][2 * half + 1]));
            tile_max = max_acc(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = max_acc(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            const Real new_max = max_acc(row_max[m][half], tile_max);
            const Real safe_max = new_max == negative_infinity<Real>() ? Real(0) : new_max;
            rescale[m][half] = exp_of_logit_difference(row_max[m][half] - safe_max);
            row_max[m][half] = new_max;
            Real tile_sum = Real(0);
#pragma unroll
            for (int n = 0; n < KeyFrags; ++n) {
                const Real p0 = exp_of_logit_difference(s[m][n][2 * half] - safe_max);
                const Real p1 = exp_of_logit_difference(s[m][n][2 * half + 1] - safe_max);
                tile_sum += p0 + p1;
                s[m][n][2 * half] = p0;
                s[m][n][2 * half + 1] = p1;
            }
            row_sum[m][half] = row_sum[m][half] * rescale[m][half] + tile_sum;
        }
}

template <typename Real, int RowTiles, int OutFrags>
__device__ __forceinline__ void rescale_output(Real (&o_acc)[RowTiles][OutFrags][4],
                                               const Real (&rescale)[RowTiles][2]) {
#pragma unroll
    for (int m = 0; m < RowTiles; ++m)
#pragma unroll
        for (int n = 0; n < OutFrags; ++n) {
            o_acc[m][n][0] *= rescale[m][0];
            o_acc[m][n][1] *= rescale[m][0];
            o_acc[m][n][2] *= rescale[m][1];
            o_acc[m][n][3] *= rescale[m][1];
        }
}

// Both halves at once: probabilities, then O rescaled.
template <typename Real, int RowTiles, int KeyFrags, int OutFrags>
__device__ __forceinline__ void online_softmax_step(Real (&s)[RowTiles][KeyFrags][4],
                                                    Real (&row_max)[RowTiles][2],
                                                    Real (&row_sum)[RowTiles][2],
                                                    Real (&o_acc)[RowTiles][OutFrags][4]) {
    Real rescale[RowTiles][2];
    softmax_probabilities(s, row_max, row_sum, rescale);
    rescale_output(o_acc, rescale);
}

// Dropout zeroes entries of the P that multiplies V (not of the row sum); the 1 / (1 - p)
// factor is applied once to O at the end. A thread's rows r and r + 8 (e = 0, 1 and 2, 3)
// share one hash a key where they are a row pair (RowPairs).
template <bool RowPairs, typename Real, int RowTiles, int KeyFrags>
__device__ __forceinline__ void drop_row_pairs(Real (&s)[RowTiles][KeyFrags][4],
                                               const u32 (&row_states)[RowTiles][2],
                                               u32 first_col, u32 threshold) {
#pragma unroll
    for (int m = 0; m < RowTiles; ++m)
#pragma unroll
        for (int n = 0; n < KeyFrags; ++n)
#pragma unroll
            for (int column = 0; column < 2; ++column) {
                bool lower, upper;
                dropout_keeps_rows<RowPairs>(row_states[m][0], row_states[m][1],
                                             first_col + n * 8 + column, threshold, lower, upper);
                if (!lower) s[m][n][column] = Real(0);
                if (!upper) s[m][n][2 + column] = Real(0);
            }
}

// `col_start` is the tile's global key position.
template <typename Real, int RowTiles, int KeyFrags>
__device__ __forceinline__ void drop_probabilities(Real (&s)[RowTiles][KeyFrags][4],
                                                   const u32 (&row_states)[RowTiles][2],
                                                   i64 col_start, u32 threshold) {
    const u32 first_col = static_cast<u32>(col_start) + 2u * (threadIdx.x % 4);
    bool pairs = true;
#pragma unroll
    for (int m = 0; m < RowTiles; ++m)
        pairs = pairs && dropout_row_pair(row_states[m][0], row_states[m][1]);
    if (pairs)
        drop_row_pairs<true>(s, row_states, first_col, threshold);
    else
        drop_row_pairs<false>(s, row_states, first_col, threshold);
}

// Deferred normalisation and the stores of o (rows of ValueDim columns; OutFrags * 8 >=
// ValueDim accumulator columns) and lse. total == 0: the row kept no key (o = 0,
// lse = -inf); a NaN total is not 0, so a NaN row stays NaN.
template <int ValueDim, typename Real, int RowTiles, int OutFrags, typename Out>
__device__ __forceinline__ void store_output_rows(const Real (&o_acc)[RowTiles][OutFrags][4],
                                                  const Real (&row_max)[RowTiles][2],
                                                  const Real (&row_sum)[RowTiles][2],
                                                  const i64 (&rows)[RowTiles][2],
                                                  OutputRows<Out> o_rows, Real* lse_head,
                                                  i64 n_q, Real dropout_scale) {
    const int quad_col = threadIdx.x % 4;
#pragma unroll
    for (int m = 0; m < RowTiles; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            Real total = row_sum[m][half];
            total += __shfl_xor_sync(0xffffffffu, total, 1);
            total += __shfl_xor_sync(0xffffffffu, total, 2);
            const i64 row = rows[m][half];
            const Real factor =
                total == Real(0) ? Real(0) : (DROPOUT ? dropout_scale : Real(1)) / total;
            if (row < n_q) {
                Out* o_row = o_rows.row0 + static_cast<i64>(static_cast<int>(row)) * o_rows.stride;
#pragma unroll
                for (int n = 0; n < OutFrags; ++n)
                    if (n * 8 < ValueDim)
                        store_row_pair<ValueDim>(o_row, n * 8 + 2 * quad_col,
                                                 o_acc[m][n][2 * half] * factor,
                                                 o_acc[m][n][2 * half + 1] * factor);
                if (quad_col == 0)
                    lse_head[row] = total == Real(0) ? negative_infinity<Real>()
                                    : kNaturalLogits ? row_max[m][half] + log_acc(total)
                                                     : row_max[m][half] * kLn2 + log_acc(total);
            }
        }
}

// Every row of a query tile that keeps no key: o = 0 (ValueDim columns a row), lse = -inf.
template <int ValueDim, int Threads, typename Out, typename Real>
__device__ __forceinline__ void store_empty_rows(OutputRows<Out> o_rows, Real* lse_head,
                                                 i64 row_start, i64 row_stop) {
    for (i64 element = threadIdx.x; element < (row_stop - row_start) * ValueDim;
         element += Threads)
        o_rows.row0[(row_start + element / ValueDim) * o_rows.stride + element % ValueDim] = 0;
    for (i64 row = row_start + threadIdx.x; row < row_stop; row += Threads)
        lse_head[row] = negative_infinity<Real>();
}
