// Tensor-core forward for float32, any D and Dv up to 256 (sm_80 and later), at float32
// accuracy through 3xTF32 (tf32.cuh): three TF32 products per float32 product; and, built
// with IS_FLOAT64, for float64 on sm_90's FP64 tensor cores (mma.sync.m16n8k8.f64: one
// IEEE double product per product, the same fragment layouts as m16n8k8.tf32), D and Dv up
// to 128 (O in doubles: kValueWidth / 2 registers a row tile).
//
// The layout of attention_mma_forward.cu (FlashAttention-2, Algorithm 1) on
// mma.sync.m16n8k8.tf32:
// * one block per (batch, head, query tile); BLOCK_Q / WARP_ROWS warps, each owning
//   WARP_ROWS (16 or 32) query rows; Q stays in shared memory and each warp splits its A
//   fragments per k8 step (the split Q of a warp would need 2 x D / 2 registers per row
//   tile, which D = 128 cannot spare beside O);
// * K/V tiles stream through shared memory with cp.async, two stages;
// * S = Q K^T in float32 accumulators, the online softmax on them in natural units
//   (IS_FLOAT32, mma.cuh's kNaturalLogits: the float32 backward recomputes P from this lse
//   without a base-2 round trip); P is
//   split and fed back as the A operand of O += P V from registers. With logical
//   k = t, t + 4 of each k8 step standing for keys 2t, 2t + 1 (tf32.cuh), S's accumulator
//   fragment of 8 keys is the A fragment of those 8 keys unchanged, and V's B fragment is
//   rows 2t, 2t + 1 of the same keys;
// * row pitches against bank conflicts: Q and K rows are D + 8 floats (the 64-bit loads of
//   a half-warp, rows g = 0..3 at columns 2t, land 8 banks apart), V rows D + 4 floats
//   (the 32-bit loads of rows 2t at column g land 8 banks apart); in float64, Q and K rows
//   of a multiple of 16 plus 8 doubles (the 16-byte loads of a quarter-warp, rows g, g + 1
//   at columns 2t, fill the 32 banks once), V rows of Dv + 2 doubles (the 8-byte loads of
//   a half-warp, rows 2t at columns g, land in 16 different bank pairs);
// * key tiles outside the band are never visited; the per-score mask runs only on tiles
//   that straddle the band edge or the end of the keys;
// * head dims that are not a multiple of 8 are zero-padded to one in shared memory.
//
// Compile-time configuration (NVRTC -D options): IS_FLOAT64, HEAD_DIM, VALUE_DIM,
// COPY_BYTES, BLOCK_Q, BLOCK_K, WARP_ROWS, LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, ALIBI, DROPOUT,
// VARLEN, PAGED (sequences.cuh).
#ifndef IS_FLOAT64
#define IS_FLOAT64 0
#endif
#if !IS_FLOAT64
#define IS_FLOAT32 1  // this kernel is the float32 forward: natural-unit logits (mma.cuh)
#endif
#include "forward_softmax.cuh"
#if IS_FLOAT64
#include "f64.cuh"
#else
#include "tf32.cuh"
#endif

#if IS_FLOAT64
typedef double real;  // inputs, outputs, shared tiles and accumulators
#else
typedef float real;
#endif
constexpr int kRowTiles = WARP_ROWS / 16;  // m16 tiles per warp
constexpr int kWarps = BLOCK_Q / WARP_ROWS;
constexpr int kThreads = kWarps * 32;
constexpr int kHeadWidth = padded_width(HEAD_DIM, 8);    // Q and K tile columns
constexpr int kValueWidth = padded_width(VALUE_DIM, 8);  // V tile and O columns
// Elements per Q and K row, and per V row, in shared memory.
constexpr int kQkPitch = IS_FLOAT64 ? padded_width(kHeadWidth, 16) + 8 : kHeadWidth + 8;
constexpr int kVPitch = IS_FLOAT64 ? kValueWidth + 2 : kValueWidth + 4;
static_assert(BLOCK_K % 8 == 0 && BLOCK_Q % WARP_ROWS == 0 && WARP_ROWS % 16 == 0,
              "mma tiles");

// Keys [row, row + BLOCK_K) of K and V into one stage's tiles (zeros past n_k).
__device__ __forceinline__ void load_key_tiles(real* k_tile, real* v_tile,
                                               const KeyRows<real>& n_k_total,
                                               const KeyRows<real>& v_rows, i64 row, i64 n_k) {
    load_rows_async<BLOCK_K, HEAD_DIM, kHeadWidth, kThreads, kQkPitch, COPY_BYTES>(
        k_tile, n_k_total, row, n_k);
    load_rows_async<BLOCK_K, VALUE_DIM, kValueWidth, kThreads, kVPitch, COPY_BYTES>(
        v_tile, v_rows, row, n_k);
}

#if IS_FLOAT64
// s = Q K^T for this warp's kRowTiles x 16 rows (from warp_row0) of the Q tile against the
// K tile's BLOCK_K keys (f64.cuh's fragments): B's b0, b1 are dims 2t, 2t + 1 of key g.
__device__ __forceinline__ void score_tile(double (&s)[kRowTiles][BLOCK_K / 8][4],
                                           const double* q_tile, const double* k_tile,
                                           int warp_row0) {
    const int lane = threadIdx.x % 32, group = lane / 4, thread_in_group = lane % 4;
#pragma unroll
    for (int m = 0; m < kRowTiles; ++m)
#pragma unroll
        for (int n = 0; n < BLOCK_K / 8; ++n)
            s[m][n][0] = s[m][n][1] = s[m][n][2] = s[m][n][3] = 0.0;
#pragma unroll
    for (int k0 = 0; k0 < kHeadWidth; k0 += 8) {
        double a[kRowTiles][4];
#pragma unroll
        for (int m = 0; m < kRowTiles; ++m)
            load_a_fragment_f64<kQkPitch>(q_tile, warp_row0 + m * 16, k0, a[m]);
#pragma unroll
        for (int n = 0; n < BLOCK_K / 8; ++n) {
            double b0, b1;
            load_shared_pair(k_tile + (n * 8 + group) * kQkPitch + k0 + 2 * thread_in_group, b0,
                             b1);
#pragma unroll
            for (int m = 0; m < kRowTiles; ++m) mma_16x8x8_f64(s[m][n], a[m], b0, b1);
        }
    }
}

// o_acc += P V for this warp's rows: the P fragment of keys 8c..8c + 7 is s[m][c] in the
// A order (a0 = s[0], a1 = s[2], a2 = s[1], a3 = s[3]: keys 2t, 2t + 1 of rows g, g + 8),
// V's b0, b1 rows 2t, 2t + 1 at column g of each 8-column output tile.
__device__ __forceinline__ void value_product(double (&o_acc)[kRowTiles][kValueWidth / 8][4],
                                              const double (&s)[kRowTiles][BLOCK_K / 8][4],
                                              const double* v_tile) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int c = 0; c < BLOCK_K / 8; ++c) {
        double a[kRowTiles][4];
#pragma unroll
        for (int m = 0; m < kRowTiles; ++m) {
            a[m][0] = s[m][c][0];
            a[m][1] = s[m][c][2];
            a[m][2] = s[m][c][1];
            a[m][3] = s[m][c][3];
        }
        const double* v_rows = v_tile + (c * 8 + 2 * (lane % 4)) * kVPitch + lane / 4;
#pragma unroll
        for (int dn = 0; dn < kValueWidth / 8; ++dn) {
            const double b0 = v_rows[dn * 8], b1 = v_rows[kVPitch + dn * 8];
#pragma unroll
            for (int m = 0; m < kRowTiles; ++m) mma_16x8x8_f64(o_acc[m][dn], a[m], b0, b1);
        }
    }
}
#else
// out[m][n] += A B for this warp's row tiles m and the output tiles n < Columns, over the
// k8 steps c < steps of one chunk: A's split fragments a_big/a_small[c][m], and B's split
// pair of step c and output tile n from b_pair(c, n, split0, split1). kChunkChains output
// tiles at a time, each into a zero tile added to out in IEEE float32 (tf32.cuh).
template <int Chunk, int Columns, typename BPair>
__device__ __forceinline__ void add_chunk_products(float (&out)[kRowTiles][Columns][4],
                                                   const u32 (&a_big)[Chunk][kRowTiles][4],
                                                   const u32 (&a_small)[Chunk][kRowTiles][4],
                                                   int steps, BPair b_pair) {
#pragma unroll
    for (int n0 = 0; n0 < Columns; n0 += kChunkChains) {
        float chunk[kChunkChains][kRowTiles][4] = {};
#pragma unroll
        for (int c = 0; c < Chunk; ++c) {
            if (c >= steps) continue;
#pragma unroll
            for (int j = 0; j < kChunkChains; ++j) {
                if (n0 + j >= Columns) continue;
                Tf32Split split0, split1;
                b_pair(c, n0 + j, split0, split1);
#pragma unroll
                for (int m = 0; m < kRowTiles; ++m)
                    mma_16x8x8_3xtf32(chunk[j][m], a_big[c][m], a_small[c][m], split0,
                                      split1);
            }
        }
#pragma unroll
        for (int j = 0; j < kChunkChains; ++j)
#pragma unroll
            for (int m = 0; m < kRowTiles; ++m)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (n0 + j < Columns) out[m][n0 + j][e] += chunk[j][m][e];
    }
}

// s = Q K^T for this warp's kRowTiles x 16 rows (from warp_row0) of the Q tile against the
// K tile's BLOCK_K keys, operands split to nearest and kScoreChunk k8 steps at a time added
// in IEEE float32 (tf32.cuh): B[k][n] = K[key n][dim k], so b0, b1 are dims 2t, 2t + 1 of
// key g.
__device__ __forceinline__ void score_tile(float (&s)[kRowTiles][BLOCK_K / 8][4],
                                           const float* q_tile, const float* k_tile,
                                           int warp_row0) {
    constexpr bool nearest = true;
    const int lane = threadIdx.x % 32, group = lane / 4, thread_in_group = lane % 4;
#pragma unroll
    for (int m = 0; m < kRowTiles; ++m)
#pragma unroll
        for (int n = 0; n < BLOCK_K / 8; ++n)
            s[m][n][0] = s[m][n][1] = s[m][n][2] = s[m][n][3] = 0.0f;
    constexpr int kSteps = kHeadWidth / 8;
#pragma unroll
    for (int k0 = 0; k0 < kSteps; k0 += kScoreChunk) {
        u32 a_big[kScoreChunk][kRowTiles][4], a_small[kScoreChunk][kRowTiles][4];
#pragma unroll
        for (int c = 0; c < kScoreChunk; ++c)
#pragma unroll
            for (int m = 0; m < kRowTiles; ++m)
                if (k0 + c < kSteps)
                    load_split_a_fragment<kQkPitch>(q_tile, warp_row0 + m * 16, (k0 + c) * 8,
                                                    a_big[c][m], a_small[c][m], nearest);
        add_chunk_products(s, a_big, a_small, kSteps - k0,
                           [&](int c, int n, Tf32Split& split0, Tf32Split& split1) {
                               float b0, b1;
                               load_shared_pair(k_tile + (n * 8 + group) * kQkPitch +
                                                    (k0 + c) * 8 + 2 * thread_in_group,
                                                b0, b1);
                               split0 = split_tf32(b0, nearest);
                               split1 = split_tf32(b1, nearest);
                           });
    }
}

// o_acc += P V for this warp's rows: P = s (probabilities), V the stage's BLOCK_K x
// kValueWidth tile. This thread's P entries of the 8-key fragment c are keys 2t, 2t + 1 of
// rows g, g + 8 (a0 = s[0], a2 = s[1], a1 = s[2], a3 = s[3]), so V's b0, b1 are rows
// 2t, 2t + 1. kProductChunk fragments at a time go into a zero tile added to o_acc in IEEE
// float32 (tf32.cuh: a large sum takes no truncated small terms).
__device__ __forceinline__ void value_product(float (&o_acc)[kRowTiles][kValueWidth / 8][4],
                                              const float (&s)[kRowTiles][BLOCK_K / 8][4],
                                              const float* v_tile) {
    const int lane = threadIdx.x % 32;
    constexpr int kSteps = BLOCK_K / 8;
#pragma unroll
    for (int c0 = 0; c0 < kSteps; c0 += kProductChunk) {
        u32 a_big[kProductChunk][kRowTiles][4], a_small[kProductChunk][kRowTiles][4];
#pragma unroll
        for (int c = 0; c < kProductChunk; ++c)
#pragma unroll
            for (int m = 0; m < kRowTiles; ++m) {
                if (c0 + c >= kSteps) continue;
                const float p[4] = {s[m][c0 + c][0], s[m][c0 + c][2], s[m][c0 + c][1],
                                    s[m][c0 + c][3]};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const Tf32Split split = split_tf32(p[i]);
                    a_big[c][m][i] = split.big;
                    a_small[c][m][i] = split.small;
                }
            }
        add_chunk_products(o_acc, a_big, a_small, kSteps - c0,
                           [&](int c, int dn, Tf32Split& split0, Tf32Split& split1) {
                               const float* v_rows =
                                   v_tile + ((c0 + c) * 8 + 2 * (lane % 4)) * kVPitch +
                                   lane / 4 + dn * 8;
                               split0 = split_tf32(v_rows[0]);
                               split1 = split_tf32(v_rows[kVPitch]);
                           });
    }
}
#endif

#if IS_FLOAT64
#define FORWARD_ENTRY attention_forward_f64
#else
#define FORWARD_ENTRY attention_forward_tf32
#endif

extern "C" __global__ void __launch_bounds__(kThreads) FORWARD_ENTRY(
    const real* q, const real* k, const real* v, real* o, real* lse,
    const double* alibi_slopes, i64 n_q_total, i64 n_k_total, int n_q_heads, int group_size, i64 q_sb,
    i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
    i64 o_sb, i64 o_sh, i64 o_sn,
    real scale, real softcap, i64 band_shift, i64 window_left, i64 window_right,
    u32 dropout_key, u32 dropout_threshold, real dropout_scale, u32 dropout_row0,
    u32 dropout_col0, SEQUENCE_PARAMETERS) {
    extern __shared__ __align__(16) real shared_reals[];
    real* q_tile = shared_reals;                       // [BLOCK_Q][kQkPitch]
    real* k_tiles = q_tile + BLOCK_Q * kQkPitch;       // [2][BLOCK_K][kQkPitch]
    real* v_tiles = k_tiles + 2 * BLOCK_K * kQkPitch;  // [2][BLOCK_K][kVPitch]

    const SequenceTables tables = SEQUENCE_TABLES;
    const QueryBlock owned =
        query_block(BLOCK_Q, n_q_total, n_k_total, band_shift, n_q_heads, group_size, tables);
    if (tile_past_rows(owned)) return;
    const i64 bh = owned.bh, n_q = owned.n_q, n_k = owned.n_k;
    const Band band{owned.band_offset, window_left, window_right};
    const real* q_head = q + owned.batch * q_sb + owned.head * q_sh + owned.row_base * q_sn;
    const KeyRows<real> k_head = key_rows(k, owned.batch, owned.kv_head, k_sb, k_sh, k_sn,
                                          owned.key_base, tables);
    const KeyRows<real> v_head = key_rows(v, owned.batch, owned.kv_head, v_sb, v_sh, v_sn,
                                          owned.key_base, tables);
    const i64 row_start = owned.row_start;
    const i64 row_stop = min(row_start + BLOCK_Q, n_q);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = lane / 4, thread_in_group = lane % 4;
    const int warp_row0 = warp * WARP_ROWS;
    i64 my_rows[kRowTiles][2];
#pragma unroll
    for (int m = 0; m < kRowTiles; ++m) {
        my_rows[m][0] = row_start + warp_row0 + m * 16 + group;
        my_rows[m][1] = my_rows[m][0] + 8;
    }

    i64 tile_begin, tile_end;
    key_tile_range<LIMIT_LEFT, LIMIT_RIGHT>(band, row_start, row_stop, n_k, BLOCK_K,
                                            &tile_begin, &tile_end);
    split_key_tiles(&tile_begin, &tile_end);
    if (tile_begin == tile_end) {  // no row of this tile keeps any key (in this share)
        store_empty_rows<VALUE_DIM, kThreads>(
            output_rows<VALUE_DIM>(o, owned, n_q_total, {o_sb, o_sh, o_sn}),
            sequence_rows<1>(lse, owned, n_q_total), row_start, row_stop);
        return;
    }

    load_tile_async<BLOCK_Q, HEAD_DIM, kHeadWidth, kThreads, kQkPitch, COPY_BYTES>(
        q_tile, q_head, q_sn, row_start, n_q);
    load_key_tiles(k_tiles, v_tiles, k_head, v_head, tile_begin * BLOCK_K, n_k);
    commit_copies();

    // O, the running max (natural units) and this thread's share of the running sum, per row.
    real o_acc[kRowTiles][kValueWidth / 8][4], row_max[kRowTiles][2], row_sum[kRowTiles][2];
    start_online_softmax(o_acc, row_max, row_sum);
    const ForwardScoresOf<real> scores =
        make_forward_scores(scale, softcap, alibi_slopes, bh, band, n_k);
    u32 row_states[kRowTiles][2];
    dropout_row_states(row_states, dropout_key, bh, my_rows, dropout_row0);

    for (i64 key_tile = tile_begin; key_tile < tile_end; ++key_tile) {
        const int stage = static_cast<int>((key_tile - tile_begin) & 1);
        if (key_tile + 1 < tile_end) {
            // The other stage was last read in the previous iteration, which ended with a
            // barrier, so it is free to refill.
            const i64 next_row = (key_tile + 1) * BLOCK_K;
            load_key_tiles(k_tiles + (stage ^ 1) * BLOCK_K * kQkPitch,
                           v_tiles + (stage ^ 1) * BLOCK_K * kVPitch, k_head, v_head,
                           next_row, n_k);
            commit_copies();
            wait_copies<1>();
        } else {
            wait_copies<0>();
        }
        __syncthreads();
        const real* k_tile = k_tiles + stage * BLOCK_K * kQkPitch;
        real* v_tile = v_tiles + stage * BLOCK_K * kVPitch;

        // S = Q K^T (3xTF32: split to nearest; NaN scores again on CUDA cores, an infinite
        // input: tf32.cuh; float64's products are IEEE's already).
        real s[kRowTiles][BLOCK_K / 8][4];
        score_tile(s, q_tile, k_tile, warp_row0);
#if !IS_FLOAT64
#pragma unroll
        for (int m = 0; m < kRowTiles; ++m)
            redo_nan_scores<kQkPitch, kHeadWidth>(s[m], q_tile, k_tile, warp_row0 + m * 16);
#endif

        const i64 col_start = key_tile * BLOCK_K;
        const bool needs_mask = key_tile_needs_mask(scores, row_start, BLOCK_Q, col_start,
                                                    BLOCK_K);
        scores_to_logits(s, my_rows, col_start, needs_mask,
                         tile_mask<LIMIT_LEFT, LIMIT_RIGHT>(band, row_start, col_start, n_k),
                         scores);
        online_softmax_step(s, row_max, row_sum, o_acc);
        if (DROPOUT) drop_probabilities(s, row_states, col_start + dropout_col0, dropout_threshold);

        // A cut tile (needs_mask is block-uniform) with a non-finite V (kept_products.cuh).
        if (kBandMasksKeys && needs_mask)
            add_and_zero_non_finite_values<BLOCK_K, kValueWidth, kVPitch, kThreads>(
                o_acc, my_rows, s, v_tile, [&] {
                    return tile_mask<LIMIT_LEFT, LIMIT_RIGHT>(band, row_start, col_start, n_k);
                });

        value_product(o_acc, s, v_tile);
        __syncthreads();  // every warp is done with this stage before it is refilled
    }

    store_output_rows<VALUE_DIM>(o_acc, row_max, row_sum, my_rows,
                                 output_rows<VALUE_DIM>(o, owned, n_q_total, {o_sb, o_sh, o_sn}),
                                 sequence_rows<1>(lse, owned, n_q_total), n_q, dropout_scale);
}
