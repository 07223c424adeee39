// Tensor-core forward for float16 / bfloat16 with D = Dv in {64, 128} (sm_80 and later).
//
// FlashAttention-2 forward (Algorithm 1) on mma.sync.m16n8k16 (fp16/bf16 in, fp32 out):
// * one block per (batch, head, query tile); BLOCK_Q / 16 warps, each owning 16 query rows
//   whose Q fragments stay in registers for the whole key loop;
// * K/V tiles stream through shared memory with cp.async, two stages: tile t+1 is in
//   flight while tile t is multiplied;
// * S = Q K^T lands in accumulator registers; the online softmax runs on them in the
//   base-2 domain (scale * log2(e) folded into one multiply, ex2.approx); P is rounded to
//   the input type and fed straight back as the A operand of O += P V, never touching
//   shared memory (the accumulator layout of m16n8 pairs is the A layout of m16k16);
// * shared rows are padded by 16 bytes so the 8 rows an ldmatrix reads hit 8 different
//   bank groups (a swizzle would save the padding; issue 5 may want it for TMA);
// * key tiles outside the band are never visited, and the per-score mask is evaluated
//   only on tiles that straddle the band edge or the end of the keys.
//
// Compile-time configuration (NVRTC -D options): IS_BFLOAT16, HEAD_DIM, BLOCK_Q, BLOCK_K,
// LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, ALIBI, DROPOUT.
#include "mma.cuh"

constexpr int kWarps = BLOCK_Q / 16;
constexpr int kThreads = kWarps * 32;
constexpr int kPitch = HEAD_DIM + 8;         // shared row pitch in 16-bit elements
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
static_assert(HEAD_DIM % 16 == 0 && BLOCK_K % 16 == 0 && BLOCK_Q % 16 == 0, "mma tiles");

// ------------------------------------------------------------------ the kernel

extern "C" __global__ void __launch_bounds__(kThreads) attention_forward_mma(
    const bits16* q, const bits16* k, const bits16* v, bits16* o, float* lse,
    const double* alibi_slopes, i64 n_q, i64 n_k, int n_q_heads, int group_size, i64 q_sb,
    i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
    float scale, float softcap, i64 band_offset, i64 window_left, i64 window_right,
    u32 dropout_key, u32 dropout_threshold, float dropout_scale) {
    extern __shared__ __align__(16) bits16 shared_tiles[];
    bits16* q_tile = shared_tiles;                     // [BLOCK_Q][kPitch]
    bits16* k_tiles = q_tile + BLOCK_Q * kPitch;       // [2][BLOCK_K][kPitch]
    bits16* v_tiles = k_tiles + 2 * BLOCK_K * kPitch;  // [2][BLOCK_K][kPitch]

    const Band band{band_offset, window_left, window_right};
    const QueryTile owned = query_tile_of_block(n_q, BLOCK_Q, n_q_heads, group_size);
    const i64 bh = owned.bh, tile = owned.tile, batch = owned.batch;
    const int head = owned.head, kv_head = owned.kv_head;
    const bits16* q_head = q + batch * q_sb + head * q_sh;
    const bits16* k_head = k + batch * k_sb + kv_head * k_sh;
    const bits16* v_head = v + batch * v_sb + kv_head * v_sh;
    const i64 row_start = tile * BLOCK_Q;
    const i64 row_stop = min(row_start + BLOCK_Q, n_q);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int quad_row = lane / 4, quad_col = lane % 4;  // accumulator fragment coordinates
    // This thread's two rows of every accumulator fragment: [0] and [0] + 8.
    const i64 my_rows[2] = {row_start + warp * 16 + quad_row, row_start + warp * 16 + quad_row + 8};

    i64 key_first, key_stop;
    band_key_range<LIMIT_LEFT, LIMIT_RIGHT>(band, row_start, row_stop, n_k, &key_first,
                                            &key_stop);
    const i64 tile_begin = key_first / BLOCK_K;
    const i64 tile_end = key_stop > key_first ? (key_stop + BLOCK_K - 1) / BLOCK_K : tile_begin;

    if (tile_begin == tile_end) {  // no row of this tile keeps any key: o = 0, lse = -inf
        for (i64 element = threadIdx.x; element < (row_stop - row_start) * HEAD_DIM;
             element += kThreads)
            o[(bh * n_q + row_start) * HEAD_DIM + element] = 0;
        for (i64 row = row_start + threadIdx.x; row < row_stop; row += kThreads)
            lse[bh * n_q + row] = negative_infinity<float>();
        return;
    }

    load_tile_async<BLOCK_Q, HEAD_DIM, kThreads>(q_tile, q_head, q_sn, row_start, n_q);
    commit_copies();
    load_tile_async<BLOCK_K, HEAD_DIM, kThreads>(k_tiles, k_head, k_sn, tile_begin * BLOCK_K, n_k);
    load_tile_async<BLOCK_K, HEAD_DIM, kThreads>(v_tiles, v_head, v_sn, tile_begin * BLOCK_K, n_k);
    commit_copies();
    wait_copies<1>();
    __syncthreads();

    // Q fragments (A operand): lanes 0-15 address rows 0-15 at column 0, lanes 16-31 the
    // same rows at column 8, giving a0..a3 of m16n8k16 in ldmatrix's register order.
    u32 q_fragments[HEAD_DIM / 16][4];
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
        load_a_fragment<HEAD_DIM>(q_tile, warp * 16, kk * 16, q_fragments[kk]);

    float o_acc[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n)
        o_acc[n][0] = o_acc[n][1] = o_acc[n][2] = o_acc[n][3] = 0.0f;
    // Running max (base-2 units) and this thread's share of the running sum, per row.
    float row_max[2] = {negative_infinity<float>(), negative_infinity<float>()};
    float row_sum[2] = {0.0f, 0.0f};

    const float scale_log2 = scale * kLog2e;
    const float scale_over_softcap = SOFTCAP ? scale / softcap : 0.0f;
    const float softcap_log2 = softcap * kLog2e;
    const float slope_log2 = ALIBI ? static_cast<float>(alibi_slopes[bh]) * kLog2e : 0.0f;
    u32 row_states[2] = {0u, 0u};
    if (DROPOUT) {
        row_states[0] = dropout_row_state(dropout_key, static_cast<u32>(bh), static_cast<u32>(my_rows[0]));
        row_states[1] = dropout_row_state(dropout_key, static_cast<u32>(bh), static_cast<u32>(my_rows[1]));
    }

    for (i64 key_tile = tile_begin; key_tile < tile_end; ++key_tile) {
        const int stage = static_cast<int>((key_tile - tile_begin) & 1);
        if (key_tile + 1 < tile_end) {
            // The other stage was last read in the previous iteration, which ended with a
            // barrier, so it is free to refill.
            load_tile_async<BLOCK_K, HEAD_DIM, kThreads>(k_tiles + (stage ^ 1) * BLOCK_K * kPitch, k_head, k_sn,
                                     (key_tile + 1) * BLOCK_K, n_k);
            load_tile_async<BLOCK_K, HEAD_DIM, kThreads>(v_tiles + (stage ^ 1) * BLOCK_K * kPitch, v_head, v_sn,
                                     (key_tile + 1) * BLOCK_K, n_k);
            commit_copies();
            wait_copies<1>();
        } else {
            wait_copies<0>();
        }
        __syncthreads();
        const bits16* k_tile = k_tiles + stage * BLOCK_K * kPitch;
        const bits16* v_tile = v_tiles + stage * BLOCK_K * kPitch;

        // S = Q K^T. B[k][n] = K[key n][dim k]: a plain ldmatrix of K's rows gives the
        // "col" B fragment; one x4 load covers two 8-key tiles.
        float s[BLOCK_K / 8][4];
#pragma unroll
        for (int n = 0; n < BLOCK_K / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
#pragma unroll
            for (int nn = 0; nn < BLOCK_K / 16; ++nn) {
                u32 b[4];
                load_b_fragments<HEAD_DIM>(k_tile, nn * 16, kk * 16, b);
                mma_16x8x16(s[2 * nn], q_fragments[kk], b[0], b[1]);
                mma_16x8x16(s[2 * nn + 1], q_fragments[kk], b[2], b[3]);
            }
        }

        // Scores in base-2 units: scale, softcap, ALiBi, then the mask by select.
        const i64 col_start = key_tile * BLOCK_K;
        bool needs_mask = col_start + BLOCK_K > n_k;
        if (LIMIT_RIGHT)
            needs_mask = needs_mask || col_start + BLOCK_K - 1 > row_start + band.offset + band.right;
        if (LIMIT_LEFT)
            needs_mask = needs_mask || col_start < row_start + BLOCK_Q - 1 + band.offset - band.left;
#pragma unroll
        for (int n = 0; n < BLOCK_K / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const i64 row = my_rows[e >> 1];
                const i64 col = col_start + n * 8 + 2 * quad_col + (e & 1);
                float score;
                if (SOFTCAP)
                    score = softcap_log2 * tanhf(s[n][e] * scale_over_softcap);
                else
                    score = s[n][e] * scale_log2;
                if (ALIBI) {
                    const i64 distance = row + band.offset - col;
                    score -= slope_log2 * static_cast<float>(distance < 0 ? -distance : distance);
                }
                if (needs_mask && !(col < n_k && band_keeps<LIMIT_LEFT, LIMIT_RIGHT>(band, row, col)))
                    score = negative_infinity<float>();
                s[n][e] = score;
            }
        }

        // Online softmax (FlashAttention-2 section 3.1.1) on the fragments. The four
        // threads of a quad share a row: max over the quad with two shuffles. Row sums
        // stay per-thread partial sums until the end, as the rescale is quad-uniform.
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float tile_max = negative_infinity<float>();
#pragma unroll
            for (int n = 0; n < BLOCK_K / 8; ++n)
                tile_max = fmaxf(tile_max, fmaxf(s[n][2 * half], s[n][2 * half + 1]));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            const float new_max = fmaxf(row_max[half], tile_max);
            const float safe_max = new_max == negative_infinity<float>() ? 0.0f : new_max;
            const float rescale = exp2_approx(row_max[half] - safe_max);
            row_max[half] = new_max;
            float tile_sum = 0.0f;
#pragma unroll
            for (int n = 0; n < BLOCK_K / 8; ++n) {
                const float p0 = exp2_approx(s[n][2 * half] - safe_max);
                const float p1 = exp2_approx(s[n][2 * half + 1] - safe_max);
                tile_sum += p0 + p1;
                s[n][2 * half] = p0;
                s[n][2 * half + 1] = p1;
            }
            row_sum[half] = row_sum[half] * rescale + tile_sum;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n) {
                o_acc[n][2 * half] *= rescale;
                o_acc[n][2 * half + 1] *= rescale;
            }
        }
        // Dropout zeroes entries of the P that multiplies V (not of the row sum); the
        // 1 / (1 - p) factor is applied once to O at the end.
        if (DROPOUT) {
#pragma unroll
            for (int n = 0; n < BLOCK_K / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const u32 col = static_cast<u32>(col_start + n * 8 + 2 * quad_col + (e & 1));
                    if (!dropout_keeps(row_states[e >> 1], col, dropout_threshold)) s[n][e] = 0.0f;
                }
        }

        // O += P V. The S accumulators of key tiles 2kk and 2kk+1 are exactly the A
        // fragment of a 16x16 P block; V's B fragment needs the transposing ldmatrix.
#pragma unroll
        for (int kk = 0; kk < BLOCK_K / 16; ++kk) {
            u32 a[4];
            pack_a_fragment(s[2 * kk], s[2 * kk + 1], a);
#pragma unroll
            for (int dn = 0; dn < HEAD_DIM / 16; ++dn) {
                u32 b[4];
                load_b_fragments_transposed<HEAD_DIM>(v_tile, kk * 16, dn * 16, b);
                mma_16x8x16(o_acc[2 * dn], a, b[0], b[1]);
                mma_16x8x16(o_acc[2 * dn + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();  // every warp is done with this stage before it is refilled
    }

    // Deferred normalisation. total == 0: the row kept no key (o = 0, lse = -inf); a NaN
    // total is not 0, so a NaN row stays NaN.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float total = row_sum[half];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        const i64 row = my_rows[half];
        const float factor = total == 0.0f ? 0.0f : (DROPOUT ? dropout_scale : 1.0f) / total;
        if (row < n_q) {
            u32* o_row = reinterpret_cast<u32*>(o + (bh * n_q + row) * HEAD_DIM);
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n)
                o_row[n * 4 + quad_col] =
                    pack_pair(o_acc[n][2 * half] * factor, o_acc[n][2 * half + 1] * factor);
            if (quad_col == 0)
                lse[bh * n_q + row] = total == 0.0f ? negative_infinity<float>()
                                                    : row_max[half] * kLn2 + logf(total);
        }
    }
}
