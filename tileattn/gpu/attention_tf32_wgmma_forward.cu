// Hopper tensor-core forward (sm_90a) for float32 at float32 accuracy: the 3xTF32 products of
// attention_tf32_forward.cu (tf32.cuh) on warpgroup matrix instructions (wgmma_tf32.cuh).
//
// With mma.sync, every TF32 product reads its operands through registers from shared
// memory, and at D = 128-256 the float32 forward was bound by that shared-memory traffic and
// the tensor pipe together (bench/NOTES-gpu.md, v43). wgmma reads its B operand (and A,
// where it comes from shared memory) straight from shared memory, 64 rows of A per
// instruction. TF32 wgmma takes both operands K-major, and big and small of each split
// operand must be in shared memory as separate tiles. So:
// * one block per (batch, head, BLOCK_Q query rows), each warpgroup owning 64 rows;
// * Q is split once per block into two swizzled tiles, big and small, the A operands of
//   S = Q K^T;
// * K and V tiles arrive raw (cp.async, row-major) in one staging buffer; a split pass of all
//   threads writes K's big and small tiles and V's transposed (Dv x keys) big and small tiles,
//   and the next raw tile is copied in while the block computes on the split ones;
// * S = Q K^T is taken kScoreChunk k8 steps at a time into zero accumulators added in IEEE
//   float32, each step's three products in the order of mma_16x8x8_3xtf32, and both
//   operands' columns stored in the order in which the mma.sync kernels feed a k8 step
//   (logical k = t, t + 4 are dims 2t, 2t + 1): a score is then the same sequence of tensor-core
//   operations as in the mma.sync forward and backward, which recompute P from this lse
//   (the large-score test needs P = 1 of a dominant key there);
// * P, split in registers, is the register A operand of O += P V, the tile's products into a
//   zero accumulator added to O in IEEE float32 (tf32.cuh, kProductChunk); with logical
//   k = t, t + 4 standing for keys 2t, 2t + 1, S's accumulator fragment is P's A fragment,
//   and V's transposed tile stores its keys in that order;
// * masks, options, non-finite inputs and variable-length / paged sources as in
//   attention_tf32_forward.cu: NaN scores again on CUDA cores (from big + small, which is the
//   input exactly), a non-finite V on a cut tile zeroed by the split pass and its kept pairs'
//   products added on CUDA cores from the raw tile.
//
// Compile-time configuration (NVRTC -D options): HEAD_DIM, VALUE_DIM, COPY_BYTES, BLOCK_Q (64
// or 128), BLOCK_K (16, 32 or 64), LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, ALIBI, DROPOUT, VARLEN,
// PAGED (sequences.cuh). Needs -arch=sm_90a.
#define IS_FLOAT32 1  // natural-unit logits (mma.cuh), as the float32 backward expects
#include "forward_softmax.cuh"
#include "tf32.cuh"
#include "wgmma_tf32.cuh"

constexpr int kWarpgroups = BLOCK_Q / 64;
constexpr int kThreads = kWarpgroups * 128;
constexpr int kHeadWidth = padded_width(HEAD_DIM, 8);     // Q and K columns: k8 steps
constexpr int kValueWidth = padded_width(VALUE_DIM, 16);  // V^T rows, O columns: wgmma's N
// O += P V in slices of kValueSlice columns, each into its own zero accumulator: O and one
// slice's accumulator must fit the registers beside the scores (at most 64 columns a slice
// above 128, the widest of 64, 48, 32, 16 that divides the width).
constexpr int kValueSlice = kValueWidth <= 128   ? kValueWidth
                            : kValueWidth % 64 == 0 ? 64
                            : kValueWidth % 48 == 0 ? 48
                            : kValueWidth % 32 == 0 ? 32
                                                    : 16;
constexpr int kSliceFrags = kValueSlice / 8;
constexpr int kHeadSteps = kHeadWidth / 8;
constexpr int kKeySteps = BLOCK_K / 8;
constexpr int kKeyFrags = BLOCK_K / 8;      // n8 fragments of S per warp
constexpr int kOutFrags = kValueWidth / 8;  // n8 fragments of O per warp
constexpr int kScoreChunks = (kHeadSteps + kScoreChunk - 1) / kScoreChunk;
using QkSwizzle = FloatSwizzled<kHeadWidth>;
using VtSwizzle = FloatSwizzled<BLOCK_K>;
// Each tile starts on the swizzle's 1024-byte period (16 rows of 8-float multiples can end
// between periods).
constexpr int kQTileBytes = padded_width(4 * BLOCK_Q * kHeadWidth, kTileAlignment);
constexpr int kKTileBytes = padded_width(4 * BLOCK_K * kHeadWidth, kTileAlignment);
constexpr int kVtTileBytes = padded_width(4 * kValueWidth * BLOCK_K, kTileAlignment);
static_assert(BLOCK_Q % 64 == 0 && BLOCK_K % 16 == 0 && BLOCK_K <= 64 && kHeadWidth <= 256 &&
                  kValueWidth <= 256 && kKeySteps <= kProductChunk,
              "tf32 wgmma tiles: one product chunk a key tile");

// Within each group of 8 columns, the position that column j takes: the mma.sync kernels'
// logical k = t, t + 4 are columns 2t, 2t + 1 (tf32.cuh), so column 2t goes to t and 2t + 1
// to t + 4.
__device__ __forceinline__ int step_position(int j) { return (j >> 1) + 4 * (j & 1); }

__device__ __forceinline__ float load_shared_float(u32 address) {
    float x;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x) : "r"(address) : "memory");
    return x;
}
__device__ __forceinline__ void store_shared_float4(u32 address, float a, float b, float c,
                                                    float d) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(address),
                 "r"(__float_as_uint(a)), "r"(__float_as_uint(b)), "r"(__float_as_uint(c)),
                 "r"(__float_as_uint(d))
                 : "memory");
}

// Eight values already in step order (position p holds column (p < 4 ? 2p : 2(p - 4) + 1))
// split into the big and small tiles at row r, columns [8 j, 8 j + 8) of a swizzled float
// tile of Width columns and `rows` rows: two 16-byte chunks each.
template <int Width>
__device__ __forceinline__ void store_split_group(u32 big, u32 small, int r, int j, int rows,
                                                  const float (&x)[8], bool nearest) {
    u32 big_bits[8], small_bits[8];
#pragma unroll
    for (int p = 0; p < 8; ++p) {
        const Tf32Split split = split_tf32(x[p], nearest);
        big_bits[p] = split.big;
        small_bits[p] = split.small;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const u32 offset = float_element<Width>(r, 8 * j + 4 * half, rows);
        const u32* b = big_bits + 4 * half;
        const u32* s = small_bits + 4 * half;
        store_shared_float4(big + offset, __uint_as_float(b[0]), __uint_as_float(b[1]),
                            __uint_as_float(b[2]), __uint_as_float(b[3]));
        store_shared_float4(small + offset, __uint_as_float(s[0]), __uint_as_float(s[1]),
                            __uint_as_float(s[2]), __uint_as_float(s[3]));
    }
}

// Row r's columns [8 j, 8 j + 8) of a row-major float tile (pitch Pitch), in step order.
template <int Pitch>
__device__ __forceinline__ void load_row_group(float (&x)[8], const float* raw, int r, int j) {
    const float4 low = *reinterpret_cast<const float4*>(raw + r * Pitch + 8 * j);
    const float4 high = *reinterpret_cast<const float4*>(raw + r * Pitch + 8 * j + 4);
    const float in_order[8] = {low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
#pragma unroll
    for (int c = 0; c < 8; ++c) x[step_position(c)] = in_order[c];
}

// Rows x kHeadWidth of a row-major raw tile (Q or K) into its split tiles, scores' split
// (to nearest). Each thread takes groups of 8 columns of a row, neighbouring threads the
// neighbouring groups (16-byte loads of a quarter warp cover 128 contiguous bytes).
template <int Rows, bool kLoadAllFirst = false>
__device__ __forceinline__ void split_score_operand(u32 big, u32 small, const float* raw) {
    constexpr int kGroups = Rows * kHeadSteps;
    constexpr int kPerThread = (kGroups + kThreads - 1) / kThreads;
    if constexpr (kLoadAllFirst) {
        // The raw tile lies where the split tiles go: read every group first.
        float x[kPerThread][8];
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
            const int group = threadIdx.x + i * kThreads;
            if (kGroups % kThreads == 0 || group < kGroups)
                load_row_group<kHeadWidth>(x[i], raw, group / kHeadSteps, group % kHeadSteps);
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
            const int group = threadIdx.x + i * kThreads;
            if (kGroups % kThreads == 0 || group < kGroups)
                store_split_group<kHeadWidth>(big, small, group / kHeadSteps,
                                              group % kHeadSteps, Rows, x[i], true);
        }
    } else {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
            const int group = threadIdx.x + i * kThreads;
            if (kGroups % kThreads == 0 || group < kGroups) {
                float x[8];
                load_row_group<kHeadWidth>(x, raw, group / kHeadSteps, group % kHeadSteps);
                store_split_group<kHeadWidth>(big, small, group / kHeadSteps,
                                              group % kHeadSteps, Rows, x, true);
            }
        }
    }
}

// The raw V tile (BLOCK_K x kValueWidth, row-major) into the split tiles of V^T
// (kValueWidth x BLOCK_K), truncating split, keys in step order. A thread takes one column
// of V and 8 keys; neighbouring threads neighbouring columns (conflict-free loads). Where
// `zero_non_finite` (a tile the mask cuts), inf and NaN become zeros and the return value
// says whether this thread met one (kept_products.cuh).
__device__ __forceinline__ bool split_values(u32 big, u32 small, const float* raw,
                                             bool zero_non_finite) {
    constexpr int kGroups = kValueWidth * kKeySteps;
    constexpr int kPerThread = (kGroups + kThreads - 1) / kThreads;
    bool found = false;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
        const int group = threadIdx.x + i * kThreads;
        if (kGroups % kThreads != 0 && group >= kGroups) continue;
        const int col = group % kValueWidth, j = group / kValueWidth;
        float x[8];
#pragma unroll
        for (int key = 0; key < 8; ++key) {
            float value = raw[(8 * j + key) * kValueWidth + col];
            if (kBandMasksKeys && zero_non_finite && bits_non_finite(value)) {
                found = true;
                value = 0.0f;
            }
            x[step_position(key)] = value;
        }
        store_split_group<BLOCK_K>(big, small, col, j, kValueWidth, x, false);
    }
    return found;
}

// Float (r, col) of a split score operand's tiles, as the input (big + small is exact).
template <int Rows>
__device__ __forceinline__ float split_operand_value(u32 big, u32 small, int r, int col) {
    const u32 offset = float_element<kHeadWidth>(r, 8 * (col / 8) + step_position(col % 8), Rows);
    return load_shared_float(big + offset) + load_shared_float(small + offset);
}

// The scores among this warp's accumulators that came out NaN, again as IEEE float32 dot
// products on CUDA cores, as tf32.cuh's redo_nan_scores does from the raw tiles (an infinite
// operand can meet its partner's small part of the other sign). q_row0: the warp's first row
// of the Q tile.
__device__ __forceinline__ void redo_nan_scores_split(float (&s)[kKeyFrags][4], u32 q_big,
                                                      u32 q_small, u32 k_big, u32 k_small,
                                                      int q_row0) {
    if (!warp_has_nan(s)) return;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int n = 0; n < kKeyFrags; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (s[n][e] == s[n][e]) continue;
            const int row = q_row0 + lane / 4 + (e / 2) * 8;
            const int key = n * 8 + 2 * (lane % 4) + e % 2;
            float dot = 0.0f;
#pragma unroll 1
            for (int d = 0; d < kHeadWidth; ++d)
                dot = fmaf(split_operand_value<BLOCK_Q>(q_big, q_small, row, d),
                           split_operand_value<BLOCK_K>(k_big, k_small, key, d), dot);
            s[n][e] = dot;
        }
}

// Keys [row, row + BLOCK_K) of K and V into the raw staging tile, row-major (zeros past n_k).
__device__ __forceinline__ void load_raw_key_tile(float* raw_k, float* raw_v,
                                                  const KeyRows<float>& k_rows,
                                                  const KeyRows<float>& v_rows, i64 row,
                                                  i64 n_k) {
    load_rows_async<BLOCK_K, HEAD_DIM, kHeadWidth, kThreads, kHeadWidth, COPY_BYTES>(
        raw_k, k_rows, row, n_k);
    load_rows_async<BLOCK_K, VALUE_DIM, kValueWidth, kThreads, kValueWidth, COPY_BYTES>(
        raw_v, v_rows, row, n_k);
}

// s = 0 + chunk 0, then s += chunk c, in IEEE float32 (the mma.sync kernels' sums).
__device__ __forceinline__ void add_score_chunk(float (&s)[kKeyFrags][4],
                                                float (&chunk)[kKeyFrags][4], int c) {
    wgmma_pin(chunk);
#pragma unroll
    for (int n = 0; n < kKeyFrags; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = (c == 0 ? 0.0f : s[n][e]) + chunk[n][e];
}

extern "C" __global__ void __launch_bounds__(kThreads, 1) attention_forward_tf32_wgmma(
    const float* q, const float* k, const float* v, float* o, float* lse,
    const double* alibi_slopes, i64 n_q_total, i64 n_k_total, int n_q_heads, int group_size,
    i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
    i64 o_sb, i64 o_sh, i64 o_sn, float scale, float softcap, i64 band_shift, i64 window_left,
    i64 window_right, u32 dropout_key, u32 dropout_threshold, float dropout_scale,
    u32 dropout_row0, u32 dropout_col0, SEQUENCE_PARAMETERS) {
    // Swizzled tiles repeat every 1024 bytes of address: aligned to it (the launch asks for
    // 1024 bytes of slack). The raw K and V tile follows the split tiles.
    extern __shared__ __align__(128) unsigned char shared_bytes[];
    const u32 base = shared_address(shared_bytes);
    const u32 q_big = (base + kTileAlignment - 1) & ~static_cast<u32>(kTileAlignment - 1);
    const u32 q_small = q_big + kQTileBytes;
    const u32 k_big = q_small + kQTileBytes;
    const u32 k_small = k_big + kKTileBytes;
    const u32 vt_big = k_small + kKTileBytes;
    const u32 vt_small = vt_big + kVtTileBytes;
    float* const raw_k = reinterpret_cast<float*>(shared_bytes + (vt_small + kVtTileBytes - base));
    float* const raw_v = raw_k + BLOCK_K * kHeadWidth;
    float* const raw_q = reinterpret_cast<float*>(shared_bytes + (q_big - base));

    const SequenceTables tables = SEQUENCE_TABLES;
    const QueryBlock owned =
        query_block(BLOCK_Q, n_q_total, n_k_total, band_shift, n_q_heads, group_size, tables);
    if (tile_past_rows(owned)) return;
    const i64 bh = owned.bh, n_q = owned.n_q, n_k = owned.n_k;
    const Band band{owned.band_offset, window_left, window_right};
    const float* q_head = q + owned.batch * q_sb + owned.head * q_sh + owned.row_base * q_sn;
    const KeyRows<float> k_head = key_rows(k, owned.batch, owned.kv_head, k_sb, k_sh, k_sn,
                                           owned.key_base, tables);
    const KeyRows<float> v_head = key_rows(v, owned.batch, owned.kv_head, v_sb, v_sh, v_sn,
                                           owned.key_base, tables);
    const i64 row_start = owned.row_start;
    const i64 row_stop = min(row_start + BLOCK_Q, n_q);
    const ForwardScores scores =
        make_forward_scores(scale, softcap, alibi_slopes, bh, band, n_k);

    const int warpgroup = threadIdx.x / 128;
    const int lane = threadIdx.x % 32;
    const int warp_row0 = warpgroup * 64 + ((threadIdx.x / 32) % 4) * 16;  // in the Q tile
    i64 my_rows[1][2];
    my_rows[0][0] = row_start + warp_row0 + lane / 4;
    my_rows[0][1] = my_rows[0][0] + 8;

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

    // Raw Q (in the place of its big tile) and the first raw K and V tile in one copy group;
    // Q split in place once it has landed.
    load_tile_async<BLOCK_Q, HEAD_DIM, kHeadWidth, kThreads, kHeadWidth, COPY_BYTES>(
        raw_q, q_head, q_sn, row_start, n_q);
    load_raw_key_tile(raw_k, raw_v, k_head, v_head, tile_begin * BLOCK_K, n_k);
    commit_copies();
    wait_copies<0>();
    __syncthreads();
    split_score_operand<BLOCK_Q, true>(q_big, q_small, raw_q);

    float o_acc[1][kOutFrags][4], row_max[1][2], row_sum[1][2];
    start_online_softmax(o_acc, row_max, row_sum);
    u32 row_states[1][2];
    dropout_row_states(row_states, dropout_key, bh, my_rows, dropout_row0);
    // This warpgroup's 64 rows of Q's tiles.
    const u32 q_big_rows = q_big + warpgroup * 64 * QkSwizzle::kRowBytes;
    const u32 q_small_rows = q_small + warpgroup * 64 * QkSwizzle::kRowBytes;

    for (i64 key_tile = tile_begin; key_tile < tile_end; ++key_tile) {
        // The raw tile has landed, and every warpgroup is done with the previous tile's
        // split tiles (each waited for its last wgmma).
        if (key_tile != tile_begin) {
            wait_copies<0>();
            __syncthreads();
        }
        const i64 col_start = key_tile * BLOCK_K;
        const bool needs_mask = key_tile_needs_mask(scores, row_start, BLOCK_Q, col_start,
                                                    BLOCK_K);
        split_score_operand<BLOCK_K>(k_big, k_small, raw_k);
        const bool values_found =
            split_values(vt_big, vt_small, raw_v, kBandMasksKeys && needs_mask);
        // The split tiles are read next by the tensor cores (the async proxy).
        fence_shared_for_async_proxy();
        // needs_mask is block-uniform, so is the barrier taken.
        const bool v_non_finite = kBandMasksKeys && needs_mask
                                      ? __syncthreads_or(values_found)
                                      : (__syncthreads(), false);
        // The raw tile is free for the next one, unless a cut tile's non-finite V still
        // needs it (below).
        const bool prefetch = key_tile + 1 < tile_end;
        if (prefetch && !v_non_finite) {
            load_raw_key_tile(raw_k, raw_v, k_head, v_head, (key_tile + 1) * BLOCK_K, n_k);
            commit_copies();
        }

        // S = Q K^T, kScoreChunk k8 steps a chunk into a zeroed accumulator (two in turn:
        // chunk c runs while chunk c - 1 is added), each step's three products small-big,
        // big-small, big-big (mma_16x8x8_3xtf32's order), the chunks added in order.
        float s[1][kKeyFrags][4];
        {
            float part[2][kKeyFrags][4];
#pragma unroll
            for (int c = 0; c < kScoreChunks; ++c) {
                float(&chunk)[kKeyFrags][4] = part[c % 2];
#pragma unroll
                for (int n = 0; n < kKeyFrags; ++n)
                    chunk[n][0] = chunk[n][1] = chunk[n][2] = chunk[n][3] = 0.0f;
                wgmma_fence();
#pragma unroll
                for (int kk = c * kScoreChunk; kk < min((c + 1) * kScoreChunk, kHeadSteps); ++kk) {
                    const u64 qb = k_major_descriptor<2 * kHeadWidth>(
                        q_big_rows + QkSwizzle::slice(kk, BLOCK_Q));
                    const u64 qs = k_major_descriptor<2 * kHeadWidth>(
                        q_small_rows + QkSwizzle::slice(kk, BLOCK_Q));
                    const u64 kb =
                        k_major_descriptor<2 * kHeadWidth>(k_big + QkSwizzle::slice(kk, BLOCK_K));
                    const u64 ks = k_major_descriptor<2 * kHeadWidth>(
                        k_small + QkSwizzle::slice(kk, BLOCK_K));
                    wgmma_ss_tf32<BLOCK_K>(chunk, qs, kb, 1);
                    wgmma_ss_tf32<BLOCK_K>(chunk, qb, ks, 1);
                    wgmma_ss_tf32<BLOCK_K>(chunk, qb, kb, 1);
                }
                wgmma_commit();
                if (c > 0) {
                    wgmma_wait<1>();
                    add_score_chunk(s[0], part[(c - 1) % 2], c - 1);
                }
            }
            wgmma_wait<0>();
            add_score_chunk(s[0], part[(kScoreChunks - 1) % 2], kScoreChunks - 1);
        }
        redo_nan_scores_split(s[0], q_big, q_small, k_big, k_small, warp_row0);

        scores_to_logits(s, my_rows, col_start, needs_mask,
                         tile_mask<LIMIT_LEFT, LIMIT_RIGHT>(band, row_start, col_start, n_k),
                         scores);
        online_softmax_step(s, row_max, row_sum, o_acc);
        if (DROPOUT) drop_probabilities(s, row_states, col_start + dropout_col0, dropout_threshold);

        // A cut tile whose V held inf or NaN: the split pass zeroed them; the kept pairs'
        // products with them on CUDA cores from the raw tile, which is then released.
        if (v_non_finite) {
            add_kept_non_finite_values<kKeyFrags>(
                o_acc,
                KeptKeysOfRows<1>{
                    my_rows, tile_mask<LIMIT_LEFT, LIMIT_RIGHT>(band, row_start, col_start, n_k)},
                HeldFromScores<1, kKeyFrags>{s},
                [&](int key, int col) { return raw_v[key * kValueWidth + col]; });
            __syncthreads();
            if (prefetch) {
                load_raw_key_tile(raw_k, raw_v, k_head, v_head, (key_tile + 1) * BLOCK_K,
                                  n_k);
                commit_copies();
            }
        }

        // O += P V: P split in registers (a0 = key 2t of row g, a1 = row g + 8, a2 = key
        // 2t + 1), V^T's k8 slice j holding keys 8 j + 2t at t and 8 j + 2t + 1 at t + 4.
        u32 p_big[kKeySteps][4], p_small[kKeySteps][4];
#pragma unroll
        for (int j = 0; j < kKeySteps; ++j) {
            const float p[4] = {s[0][j][0], s[0][j][2], s[0][j][1], s[0][j][3]};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const Tf32Split split = split_tf32(p[i]);
                p_big[j][i] = split.big;
                p_small[j][i] = split.small;
            }
        }
#pragma unroll
        for (int slice = 0; slice < kValueWidth / kValueSlice; ++slice) {
            float product[kSliceFrags][4];
#pragma unroll
            for (int n = 0; n < kSliceFrags; ++n)
                product[n][0] = product[n][1] = product[n][2] = product[n][3] = 0.0f;
            wgmma_fence();
            // The slice's V^T rows start kValueSlice rows further per slice, in every column
            // block of the tile.
            const u32 rows = slice * kValueSlice * VtSwizzle::kRowBytes;
#pragma unroll
            for (int j = 0; j < kKeySteps; ++j) {
                const u64 vb = k_major_descriptor<2 * BLOCK_K>(
                    vt_big + rows + VtSwizzle::slice(j, kValueWidth));
                const u64 vs = k_major_descriptor<2 * BLOCK_K>(
                    vt_small + rows + VtSwizzle::slice(j, kValueWidth));
                wgmma_rs_tf32<kValueSlice>(product, p_small[j], vb, 1);
                wgmma_rs_tf32<kValueSlice>(product, p_big[j], vs, 1);
                wgmma_rs_tf32<kValueSlice>(product, p_big[j], vb, 1);
            }
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_pin(product);
#pragma unroll
            for (int n = 0; n < kSliceFrags; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) o_acc[0][slice * kSliceFrags + n][e] += product[n][e];
        }
    }

    store_output_rows<VALUE_DIM>(o_acc, row_max, row_sum, my_rows,
                                 output_rows<VALUE_DIM>(o, owned, n_q_total, {o_sb, o_sh, o_sn}),
                                 sequence_rows<1>(lse, owned, n_q_total), n_q, dropout_scale);
}
