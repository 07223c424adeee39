// The element-wise half of the tensor-core backwards (attention_mma_backward.cu with
// mma.sync, attention_wgmma_backward.cu with wgmma): probabilities recomputed from lse in
// the forward's logit units (kLogitUnit, mma.cuh: base 2 for 16-bit inputs, natural for
// float32), the softcap's derivative, ALiBi, the band and dropout, per score.
#pragma once
#include "mma.cuh"

// The run-time score options, pre-multiplied into logit units where they scale a score, in
// the accumulators' type Real (float; double for the float64 backward: every function
// below takes either).
template <typename Real> struct ScoresOf {
    Real logit_scale;         // scale * kLogitUnit
    Real scale_over_softcap;  // scale / softcap
    Real logit_softcap;       // softcap * kLogitUnit
    Real logit_slope;         // this head's ALiBi slope * kLogitUnit
    Band band;
    u32 dropout_key;
    u32 dropout_threshold;
    Real dropout_scale;
    u32 dropout_row0;  // global position of row 0 and key 0 (a block of a longer sequence)
    u32 dropout_col0;
    u32 bh;  // b * Hq + h of the query head: ALiBi slope and dropout stream
};
using Scores = ScoresOf<float>;

template <typename Real>
__device__ __forceinline__ ScoresOf<Real> make_scores(Real scale, Real softcap,
                                                      const double* slopes, i64 bh, Band band,
                                                      u32 dropout_key, u32 dropout_threshold,
                                                      Real dropout_scale, u32 dropout_row0,
                                                      u32 dropout_col0) {
    ScoresOf<Real> scores;
    set_logit_factors(scores, scale, softcap, slopes, bh);
    scores.band = band;
    scores.dropout_key = dropout_key;
    scores.dropout_threshold = dropout_threshold;
    scores.dropout_scale = dropout_scale;
    scores.dropout_row0 = dropout_row0;
    scores.dropout_col0 = dropout_col0;
    scores.bh = static_cast<u32>(bh);
    return scores;
}

// lse in logit units, with -inf (a row that kept nothing) turned into +inf so that every P
// of the row comes out e^(logit - inf) = 0.
template <typename Real> __device__ __forceinline__ Real lse_in_logit_units(Real lse) {
    return lse == negative_infinity<Real>() ? -negative_infinity<Real>()
                                            : lse * static_cast<Real>(kLogitUnit);
}

// Whether the tile of queries [row_start, row_start + rows) x keys [col_start,
// col_start + cols) straddles the band edge (some but maybe not all scores masked).
__device__ __forceinline__ bool tile_straddles_band(const Band& band, i64 row_start, int rows,
                                                    i64 col_start, int cols) {
    bool straddles = false;
    if (LIMIT_RIGHT) straddles = straddles || col_start + cols - 1 > row_start + band.offset + band.right;
    if (LIMIT_LEFT) straddles = straddles || col_start < row_start + rows - 1 + band.offset - band.left;
    return straddles;
}

// P_ij = e^(logit - lse), both in logit units, for the raw q.k `dot`, and d(score)/d(scaled dot)
// (the softcap's 1 - tanh^2, else 1) in *capped_grad; 0 unless `kept` (the band and the key
// range, from a TileMask).
template <typename Real>
__device__ __forceinline__ Real probability(const ScoresOf<Real>& scores, Real dot, Real row_lse,
                                            i64 query, i64 key, bool kept, Real* capped_grad) {
    Real score;
    if (SOFTCAP) {
        const Real capped = tanh_acc(dot * scores.scale_over_softcap);
        score = scores.logit_softcap * capped;
        *capped_grad = Real(1) - capped * capped;
    } else {
        score = dot * scores.logit_scale;
        *capped_grad = Real(1);
    }
    if (ALIBI) {
        const i64 distance = query + scores.band.offset - key;
        score -= scores.logit_slope * static_cast<Real>(distance < 0 ? -distance : distance);
    }
    if (!kept) score = negative_infinity<Real>();
    return exp_of_logit_difference(score - row_lse);
}

// keep / (1 - dropout_p) for (query, key), the factor the forward applied to P_ij.
template <typename Real>
__device__ __forceinline__ Real dropout_factor(const ScoresOf<Real>& scores, u32 row_state,
                                               i64 key) {
    if (!DROPOUT) return Real(1);
    return dropout_keeps(row_state, static_cast<u32>(key) + scores.dropout_col0,
                         scores.dropout_threshold)
               ? scores.dropout_scale
               : Real(0);
}

template <typename Real>
__device__ __forceinline__ u32 dropout_state(const ScoresOf<Real>& scores, i64 query) {
    return DROPOUT ? dropout_row_state(scores.dropout_key, scores.bh,
                                       static_cast<u32>(query) + scores.dropout_row0)
                   : 0u;
}

// A dQ kernel's terms for the two query rows `rows` a thread holds: lse in logit units, D and the
// dropout state. Rows past n_q get lse = -inf, hence P = 0: they need no mask.
template <typename Real>
__device__ __forceinline__ void load_query_row_terms(const ScoresOf<Real>& scores,
                                                     const Real* lse, const Real* delta, i64 bh,
                                                     i64 n_q, const i64 (&rows)[2],
                                                     Real (&row_lse)[2], Real (&row_delta)[2],
                                                     u32 (&row_states)[2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const bool valid = rows[half] < n_q;
        row_lse[half] = lse_in_logit_units(valid ? lse[bh * n_q + rows[half]]
                                                 : negative_infinity<Real>());
        row_delta[half] = valid ? delta[bh * n_q + rows[half]] : Real(0);
        row_states[half] = dropout_state(scores, rows[half]);
    }
}

// ------------------------------------------------------------------ the single pass's dQ

// *pair += (low, high), atomically per float. sm_90 has a two-float reduction: one request
// per pair, so the four lanes that share a row cover one 32-byte sector.
__device__ __forceinline__ void add_pair(float* pair, float low, float high) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(pair), "f"(low), "f"(high)
                 : "memory");
#else
    atomicAdd(pair, low);
    atomicAdd(pair + 1, high);
#endif
}

// dq = scale * dq_sum, rounded to the input type (the single pass's last step). With
// `parts` > 1 (DQ_PARTS), dq_sum holds `parts` slots of `head_elements` (Nq x D) floats per
// batch x head, summed in slot order (the key blocks', so every run adds alike).
__device__ __forceinline__ float dq_total(const float* dq_sum, i64 i, int parts,
                                          i64 head_elements) {
    if (parts == 1) return dq_sum[i];
    const float* slot = dq_sum + i / head_elements * parts * head_elements + i % head_elements;
    float total = 0.0f;
    for (int p = 0; p < parts; ++p) total += slot[p * head_elements];
    return total;
}

#if defined(IS_FLOAT32) && IS_FLOAT32
extern "C" __global__ void attention_backward_dq_convert(const float* dq_sum, float* dq,
                                                         i64 count, float scale, int parts,
                                                         i64 head_elements) {
    for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < count;
         i += static_cast<i64>(gridDim.x) * blockDim.x)
        dq[i] = scale * dq_total(dq_sum, i, parts, head_elements);
}
#else
extern "C" __global__ void attention_backward_dq_convert(const float* dq_sum, bits16* dq,
                                                         i64 count, float scale, int parts,
                                                         i64 head_elements) {
    for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < count / 2;
         i += static_cast<i64>(gridDim.x) * blockDim.x)
        reinterpret_cast<u32*>(dq)[i] =
            pack_pair(scale * dq_total(dq_sum, 2 * i, parts, head_elements),
                      scale * dq_total(dq_sum, 2 * i + 1, parts, head_elements));
}
#endif

// The same into a dq at any batch, head and row strides (elements; rows contiguous): a
// "bshd" gradient in the caller's order. dq_sum is contiguous (B, H, [parts,] Nq, D).
#if defined(IS_FLOAT32) && IS_FLOAT32
typedef float dq_element;
#else
typedef bits16 dq_element;
#endif
extern "C" __global__ void attention_backward_dq_convert_strided(
    const float* dq_sum, dq_element* dq, i64 count, float scale, int parts,
    i64 head_elements, int n_heads, i64 n_q, int head_dim, i64 dq_sb, i64 dq_sh, i64 dq_sn) {
    for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < count;
         i += static_cast<i64>(gridDim.x) * blockDim.x) {
        const i64 row = i / head_dim, column = i % head_dim;
        const i64 head_row = row % n_q, bh = row / n_q;
        const i64 at = bh / n_heads * dq_sb + bh % n_heads * dq_sh + head_row * dq_sn + column;
        const float value = scale * dq_total(dq_sum, i, parts, head_elements);
#if defined(IS_FLOAT32) && IS_FLOAT32
        dq[at] = value;
#else
        dq[at] = static_cast<bits16>(pack_pair(value, 0.0f) & 0xffffu);
#endif
    }
}

// The score options' real parameters come in the accumulators' type.
#if defined(IS_FLOAT64) && IS_FLOAT64
typedef double score_real;
#else
typedef float score_real;
#endif
#define SCORE_OPTION_PARAMS                                                                  \
    score_real scale, score_real softcap, i64 band_offset, i64 window_left,                  \
        i64 window_right, u32 dropout_key, u32 dropout_threshold, score_real dropout_scale,  \
        u32 dropout_row0, u32 dropout_col0


// ------------------------------------------------------------------ per-tile element loops
// On one warp's accumulator fragments (the m16n8 layout of mma.sync, shared by wgmma's
// per-warp slice): Frags n8 fragments, thread (quad_row, quad_col) holding rows quad_row
// and quad_row + 8, columns 8 n + 2 quad_col + {0, 1}.

// keep / (1 - dropout_p) of the rows `row_states` (r and r + 8) at `key`; RowPairs: they are
// one row pair, so one hash serves both.
template <bool RowPairs, typename Real>
__device__ __forceinline__ void dropout_factors_of_rows(const ScoresOf<Real>& scores,
                                                        const u32 (&row_states)[2], i64 key,
                                                        Real (&factors)[2]) {
    factors[0] = factors[1] = Real(1);
    if (!DROPOUT) return;
    bool lower, upper;
    dropout_keeps_rows<RowPairs>(row_states[0], row_states[1],
                                 static_cast<u32>(key) + scores.dropout_col0,
                                 scores.dropout_threshold, lower, upper);
    factors[0] = lower ? scores.dropout_scale : Real(0);
    factors[1] = upper ? scores.dropout_scale : Real(0);
}

template <bool RowPairs, typename Real, int Frags>
__device__ __forceinline__ void scores_to_ds_rows(const ScoresOf<Real>& scores,
                                                  Real (&s)[Frags][4], const Real (&dp)[Frags][4],
                                                  const Real (&row_lse)[2], const i64 (&rows)[2],
                                                  const u32 (&row_states)[2],
                                                  const Real (&row_delta)[2], i64 key_start,
                                                  bool masked, const TileMask& mask) {
    const int quad_col = threadIdx.x % 4;
    // This thread's keys are n * 8 + column past 2 * quad_col.
    const Window kept[2] = {mask.row_window(static_cast<int>(rows[0] - mask.row0), 2 * quad_col),
                            mask.row_window(static_cast<int>(rows[1] - mask.row0), 2 * quad_col)};
#pragma unroll
    for (int n = 0; n < Frags; ++n)
#pragma unroll
        for (int column = 0; column < 2; ++column) {
            const i64 key = key_start + n * 8 + 2 * quad_col + column;
            Real factors[2];
            dropout_factors_of_rows<RowPairs>(scores, row_states, key, factors);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int e = 2 * half + column;
                const bool kept_pair = !masked || kept[half].keeps(n * 8 + column);
                Real capped_grad;
                const Real p = probability(scores, s[n][e], row_lse[half], rows[half], key,
                                           kept_pair, &capped_grad);
                // A masked dS is 0 by this select, not P = 0 times a dP that may be NaN
                // there (a non-finite V or dO), nor a P that is NaN on a row whose lse is.
                s[n][e] = kept_pair
                              ? p * capped_grad * (dp[n][e] * factors[half] - row_delta[half])
                              : Real(0);
            }
        }
}

// dQ kernel: S -> dS = P * (dP * dropout - D) * softcap', in place.
template <typename Real, int Frags>
__device__ __forceinline__ void scores_to_ds(const ScoresOf<Real>& scores, Real (&s)[Frags][4],
                                             const Real (&dp)[Frags][4],
                                             const Real (&row_lse)[2], const i64 (&rows)[2],
                                             const u32 (&row_states)[2],
                                             const Real (&row_delta)[2], i64 key_start,
                                             bool masked, const TileMask& mask) {
    if (!DROPOUT || dropout_row_pair(row_states[0], row_states[1]))
        scores_to_ds_rows<true>(scores, s, dp, row_lse, rows, row_states, row_delta, key_start,
                                masked, mask);
    else
        scores_to_ds_rows<false>(scores, s, dp, row_lse, rows, row_states, row_delta, key_start,
                                 masked, mask);
}

// dK/dV kernel: S^T -> P^T (after dropout) and dP^T -> dS^T in place, for this thread's two
// keys `keys` against the query tile starting at `query_start`, whose lse and D sit in
// shared memory. Queries past n_q get lse = -inf, hence P = 0 from a finite score.
// QueryTail (a query tile may end past n_q): those queries' P^T and dS^T are 0 by select,
// since their zero rows of Q score 0 x inf = NaN against an infinite key, and e^(NaN) is
// no 0. The float32 kernel takes it where Nq is not a multiple of the streamed tile; the
// 16-bit ones do not (a select per element there costs 6-10 % of the backward,
// bench/NOTES-gpu.md v21). ZeroKeysPastEnd: keys past n_k (zero rows of K) get P = 0
// explicitly, for products that carry dS to dQ: their P is e^(-lse), which may overflow,
// and inf * 0 would be NaN.
// `mask` is relative to (query_start, the block's first key `col0`) and applies when
// `masked`.
// RowPairs: the queries n * 8 + ... of even n and the same of n + 1 (8 apart) are one row pair
// for the dropout hash, so one hash a key serves both.
template <bool RowPairs, int Frags, bool ZeroKeysPastEnd, bool QueryTail, typename Real>
__device__ __forceinline__ void transposed_probabilities_rows(
    const ScoresOf<Real>& scores, Real (&st)[Frags][4], Real (&dpt)[Frags][4],
    const Real* lse_tile, const Real* delta_tile, i64 query_start, const i64 (&keys)[2],
    i64 col0, i64 n_q, i64 n_k, bool masked, const TileMask& mask) {
    const int quad_col = threadIdx.x % 4;
    // This thread's queries are n * 8 + column past 2 * quad_col.
    const Window kept[2] = {mask.column_window(static_cast<int>(keys[0] - col0), 2 * quad_col),
                            mask.column_window(static_cast<int>(keys[1] - col0), 2 * quad_col)};
#pragma unroll
    for (int pair = 0; pair < (Frags + 1) / 2; ++pair)
#pragma unroll
        for (int column = 0; column < 2; ++column) {
            u32 bits[2] = {0u, 0u};  // RowPairs: the pair's hash at each key
            if (DROPOUT && RowPairs) {
                const u32 lower = dropout_state(scores, query_start + pair * 16 + 2 * quad_col +
                                                            column);
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    bits[half] = dropout_pair_bits(
                        lower, static_cast<u32>(keys[half]) + scores.dropout_col0);
            }
#pragma unroll
            for (int upper = 0; upper < 2; ++upper) {
                const int n = 2 * pair + upper;
                if (n >= Frags) break;
                const int r = n * 8 + 2 * quad_col + column;
                const i64 query = query_start + r;
                const Real query_lse =
                    lse_in_logit_units(query < n_q ? lse_tile[r] : negative_infinity<Real>());
                const Real query_delta = delta_tile[r];
                const u32 row_state = RowPairs ? 0u : dropout_state(scores, query);
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int e = 2 * half + column;
                    const i64 key = keys[half];
                    const bool kept_pair = (!masked || kept[half].keeps(n * 8 + column)) &&
                                           (!QueryTail || query < n_q);
                    Real capped_grad;
                    Real p = probability(scores, st[n][e], query_lse, query, key, kept_pair,
                                         &capped_grad);
                    if (ZeroKeysPastEnd && key >= n_k) p = Real(0);
                    Real factor = Real(1);
                    if (DROPOUT && RowPairs)
                        factor = (upper ? dropout_upper_keeps(bits[half], scores.dropout_threshold)
                                        : dropout_lower_keeps(bits[half], scores.dropout_threshold))
                                     ? scores.dropout_scale
                                     : Real(0);
                    else if (DROPOUT)
                        factor = dropout_factor(scores, row_state, key);
                    // Masked P^T and dS^T are 0 by select (as in scores_to_ds).
                    st[n][e] = kept_pair ? p * factor : Real(0);
                    dpt[n][e] = kept_pair ? p * capped_grad * (dpt[n][e] * factor - query_delta)
                                          : Real(0);
                }
            }
        }
}

template <int Frags, bool ZeroKeysPastEnd, bool QueryTail, typename Real>
__device__ __forceinline__ void transposed_probabilities(const ScoresOf<Real>& scores,
                                                         Real (&st)[Frags][4],
                                                         Real (&dpt)[Frags][4],
                                                         const Real* lse_tile,
                                                         const Real* delta_tile,
                                                         i64 query_start, const i64 (&keys)[2],
                                                         i64 col0, i64 n_q, i64 n_k,
                                                         bool masked, const TileMask& mask) {
    // Queries i and i + 8 of 16 are one row pair where the tile's global start is a
    // multiple of 16.
    if (!DROPOUT || ((static_cast<u32>(query_start) + scores.dropout_row0) & 15u) == 0u)
        transposed_probabilities_rows<true, Frags, ZeroKeysPastEnd, QueryTail>(
            scores, st, dpt, lse_tile, delta_tile, query_start, keys, col0, n_q, n_k, masked,
            mask);
    else
        transposed_probabilities_rows<false, Frags, ZeroKeysPastEnd, QueryTail>(
            scores, st, dpt, lse_tile, delta_tile, query_start, keys, col0, n_q, n_k, masked,
            mask);
}
