// Tensor-core forward for float16 / bfloat16, any D and Dv up to 256 (sm_80 and later).
//
// FlashAttention-2 forward (Algorithm 1) on mma.sync.m16n8k16 (fp16/bf16 in, fp32 out):
// * one block per (batch, head, query tile); BLOCK_Q / WARP_ROWS warps, each owning
//   WARP_ROWS (16 or 32) query rows. A warp of 32 rows multiplies every K and V fragment it
//   loads twice, halving the ldmatrix traffic per mma (at 16 rows the loop is bound by
//   shared-memory bandwidth, not by the tensor cores);
// * Q fragments stay in registers for the whole key loop (Q_IN_REGISTERS) or are re-read
//   from the shared Q tile for each product, which frees registers for 32-row warps at
//   D = 128;
// * K/V tiles stream through shared memory with cp.async, two stages: tile t+1 is in
//   flight while tile t is multiplied;
// * S = Q K^T lands in accumulator registers; the online softmax runs on them in the
//   base-2 domain (scale * log2(e) folded into one multiply, ex2.approx); P is rounded to
//   the input type and fed straight back as the A operand of O += P V, never touching
//   shared memory (the accumulator layout of m16n8 pairs is the A layout of m16k16);
// * shared rows are padded by 16 bytes so the 8 rows an ldmatrix reads hit 8 different
//   bank groups (a swizzle would save the padding; issue 5 may want it for TMA);
// * key tiles outside the band are never visited, and the per-score mask is evaluated
//   only on tiles that straddle the band edge or the end of the keys;
// * head dims that are not a multiple of 16 are zero-padded to one in shared memory (the
//   caller's rows are read in place, in copies of COPY_BYTES).
//
// Compile-time configuration (NVRTC -D options): IS_BFLOAT16, HEAD_DIM, VALUE_DIM,
// COPY_BYTES, BLOCK_Q, BLOCK_K, WARP_ROWS, Q_IN_REGISTERS, LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP,
// ALIBI, DROPOUT, VARLEN, PAGED (sequences.cuh).
#include "forward_softmax.cuh"

constexpr int kRowTiles = WARP_ROWS / 16;  // m16 tiles per warp
constexpr int kWarps = BLOCK_Q / WARP_ROWS;
constexpr int kThreads = kWarps * 32;
constexpr int kHeadWidth = padded_width(HEAD_DIM, 16);    // Q and K tile columns
constexpr int kValueWidth = padded_width(VALUE_DIM, 16);  // V tile and O columns
constexpr int kQkPitch = kTilePitch<kHeadWidth>;          // shared row pitches (elements)
constexpr int kVPitch = kTilePitch<kValueWidth>;
static_assert(BLOCK_K % 16 == 0 && BLOCK_Q % WARP_ROWS == 0 && WARP_ROWS % 16 == 0,
              "mma tiles");

// Keys [row, row + BLOCK_K) of K and V into one stage's tiles (zeros past n_k).
__device__ __forceinline__ void load_key_tiles(bits16* k_tile, bits16* v_tile,
                                               const KeyRows<bits16>& n_k_total,
                                               const KeyRows<bits16>& v_rows, i64 row,
                                               i64 n_k) {
    load_rows_async<BLOCK_K, HEAD_DIM, kHeadWidth, kThreads, kQkPitch, COPY_BYTES>(
        k_tile, n_k_total, row, n_k);
    load_rows_async<BLOCK_K, VALUE_DIM, kValueWidth, kThreads, kVPitch, COPY_BYTES>(
        v_tile, v_rows, row, n_k);
}

// ------------------------------------------------------------------ the kernel

extern "C" __global__ void __launch_bounds__(kThreads) attention_forward_mma(
    const bits16* q, const bits16* k, const bits16* v, bits16* o, float* lse,
    const double* alibi_slopes, i64 n_q_total, i64 n_k_total, int n_q_heads, int group_size, i64 q_sb,
    i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
    i64 o_sb, i64 o_sh, i64 o_sn,
    float scale, float softcap, i64 band_shift, i64 window_left, i64 window_right,
    u32 dropout_key, u32 dropout_threshold, float dropout_scale, u32 dropout_row0,
    u32 dropout_col0, SEQUENCE_PARAMETERS) {
    extern __shared__ __align__(16) bits16 shared_tiles[];
    bits16* q_tile = shared_tiles;                       // [BLOCK_Q][kQkPitch]
    bits16* k_tiles = q_tile + BLOCK_Q * kQkPitch;       // [2][BLOCK_K][kQkPitch]
    bits16* v_tiles = k_tiles + 2 * BLOCK_K * kQkPitch;  // [2][BLOCK_K][kVPitch]

    const SequenceTables tables = SEQUENCE_TABLES;
    const QueryBlock owned =
        query_block(BLOCK_Q, n_q_total, n_k_total, band_shift, n_q_heads, group_size, tables);
    if (tile_past_rows(owned)) return;
    const i64 bh = owned.bh, n_q = owned.n_q, n_k = owned.n_k;
    const Band band{owned.band_offset, window_left, window_right};
    const bits16* q_head = q + owned.batch * q_sb + owned.head * q_sh + owned.row_base * q_sn;
    const KeyRows<bits16> k_head = key_rows(k, owned.batch, owned.kv_head, k_sb, k_sh, k_sn,
                                            owned.key_base, tables);
    const KeyRows<bits16> v_head = key_rows(v, owned.batch, owned.kv_head, v_sb, v_sh, v_sn,
                                            owned.key_base, tables);
    const i64 row_start = owned.row_start;
    const i64 row_stop = min(row_start + BLOCK_Q, n_q);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int quad_row = lane / 4;  // this thread's row in each accumulator fragment
    const int warp_row0 = warp * WARP_ROWS;                // first tile row of this warp
    // This thread's two rows of every accumulator fragment of row tile m: [m][0], [m][0] + 8.
    i64 my_rows[kRowTiles][2];
#pragma unroll
    for (int m = 0; m < kRowTiles; ++m) {
        my_rows[m][0] = row_start + warp_row0 + m * 16 + quad_row;
        my_rows[m][1] = my_rows[m][0] + 8;
    }
    // A warp whose rows all lie past the tile's last row (a short last tile: a decode's
    // group folded into a few rows of a 64-row tile, a sequence's end) skips its products:
    // its Q rows are zeros, so S stays 0 as the product would leave it, and its O is never
    // stored. It still copies tiles and meets every barrier.
    const bool warp_has_rows = row_start + warp_row0 < row_stop;

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
    commit_copies();
    load_key_tiles(k_tiles, v_tiles, k_head, v_head, tile_begin * BLOCK_K, n_k);
    commit_copies();
    wait_copies<1>();
    __syncthreads();

    // Q fragments (A operand): lanes 0-15 address rows 0-15 at column 0, lanes 16-31 the
    // same rows at column 8, giving a0..a3 of m16n8k16 in ldmatrix's register order.
#if Q_IN_REGISTERS
    u32 q_fragments[kRowTiles][kHeadWidth / 16][4];
#pragma unroll
    for (int m = 0; m < kRowTiles; ++m)
#pragma unroll
        for (int kk = 0; kk < kHeadWidth / 16; ++kk)
            load_a_fragment<kHeadWidth>(q_tile, warp_row0 + m * 16, kk * 16, q_fragments[m][kk]);
#endif

    // O, the running max (base-2 units) and this thread's share of the running sum, per row.
    float o_acc[kRowTiles][kValueWidth / 8][4], row_max[kRowTiles][2], row_sum[kRowTiles][2];
    start_online_softmax(o_acc, row_max, row_sum);
    const ForwardScores scores =
        make_forward_scores(scale, softcap, alibi_slopes, bh, band, n_k);
    u32 row_states[kRowTiles][2];
    dropout_row_states(row_states, dropout_key, bh, my_rows, dropout_row0);

    for (i64 key_tile = tile_begin; key_tile < tile_end; ++key_tile) {
        const int stage = static_cast<int>((key_tile - tile_begin) & 1);
        if (key_tile + 1 < tile_end) {
            // The other stage was last read in the previous iteration, which ended with a
            // barrier, so it is free to refill.
            load_key_tiles(k_tiles + (stage ^ 1) * BLOCK_K * kQkPitch,
                           v_tiles + (stage ^ 1) * BLOCK_K * kVPitch, k_head, v_head,
                           (key_tile + 1) * BLOCK_K, n_k);
            commit_copies();
            wait_copies<1>();
        } else {
            wait_copies<0>();
        }
        __syncthreads();
        const bits16* k_tile = k_tiles + stage * BLOCK_K * kQkPitch;
        bits16* v_tile = v_tiles + stage * BLOCK_K * kVPitch;

        // S = Q K^T. B[k][n] = K[key n][dim k]: a plain ldmatrix of K's rows gives the
        // "col" B fragment; one x4 load covers two 8-key tiles.
        float s[kRowTiles][BLOCK_K / 8][4];
#pragma unroll
        for (int m = 0; m < kRowTiles; ++m)
#pragma unroll
            for (int n = 0; n < BLOCK_K / 8; ++n)
                s[m][n][0] = s[m][n][1] = s[m][n][2] = s[m][n][3] = 0.0f;
        if (warp_has_rows) {
#pragma unroll
            for (int kk = 0; kk < kHeadWidth / 16; ++kk) {
#if Q_IN_REGISTERS
#define Q_FRAGMENT(m) q_fragments[m][kk]
#else
                u32 a[kRowTiles][4];
#pragma unroll
                for (int m = 0; m < kRowTiles; ++m)
                    load_a_fragment<kHeadWidth>(q_tile, warp_row0 + m * 16, kk * 16, a[m]);
#define Q_FRAGMENT(m) a[m]
#endif
#pragma unroll
                for (int nn = 0; nn < BLOCK_K / 16; ++nn) {
                    u32 b[4];
                    load_b_fragments<kHeadWidth>(k_tile, nn * 16, kk * 16, b);
#pragma unroll
                    for (int m = 0; m < kRowTiles; ++m) {
                        mma_16x8x16(s[m][2 * nn], Q_FRAGMENT(m), b[0], b[1]);
                        mma_16x8x16(s[m][2 * nn + 1], Q_FRAGMENT(m), b[2], b[3]);
                    }
                }
#undef Q_FRAGMENT
            }
        }

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

        // O += P V. The S accumulators of key tiles 2kk and 2kk+1 are exactly the A
        // fragment of a 16x16 P block; V's B fragment needs the transposing ldmatrix.
        if (warp_has_rows) {
#pragma unroll
            for (int kk = 0; kk < BLOCK_K / 16; ++kk) {
                u32 a[kRowTiles][4];
#pragma unroll
                for (int m = 0; m < kRowTiles; ++m)
                    pack_a_fragment(s[m][2 * kk], s[m][2 * kk + 1], a[m]);
#pragma unroll
                for (int dn = 0; dn < kValueWidth / 16; ++dn) {
                    u32 b[4];
                    load_b_fragments_transposed<kValueWidth>(v_tile, kk * 16, dn * 16, b);
#pragma unroll
                    for (int m = 0; m < kRowTiles; ++m) {
                        mma_16x8x16(o_acc[m][2 * dn], a[m], b[0], b[1]);
                        mma_16x8x16(o_acc[m][2 * dn + 1], a[m], b[2], b[3]);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with this stage before it is refilled
    }

    store_output_rows<VALUE_DIM>(o_acc, row_max, row_sum, my_rows,
                                 output_rows<VALUE_DIM>(o, owned, n_q_total, {o_sb, o_sh, o_sn}),
                                 sequence_rows<1>(lse, owned, n_q_total), n_q, dropout_scale);
}
