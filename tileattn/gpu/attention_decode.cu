// Split-KV decode forward (Flash-Decoding) with GQA packing, every dtype, D and Dv <= 256.
//
// Decoding is a few query rows (Nq = 1..16 new tokens per sequence) against a long K/V cache:
// reading K and V once is the whole cost, so the kernel is built around the memory system:
// * GQA packing: one block owns one (batch, kv head) and its group * Nq query rows of the
//   heads that share it (packed row r is query head kv_head * group + r / Nq, query row
//   r % Nq), so each K/V byte is read once per group, not once per query head. Those rows
//   are also contiguous in o and lse ((b * Hkv + kv_head) * group * Nq + r), which the
//   stores use. More packed rows than ROWS take row groups: blocks of ROWS rows each
//   (grid = B * Hkv * row groups * n_splits), each reading the K/V of its group.
// * Split-KV: the key tiles of the band are cut into `n_splits` contiguous ranges, one
//   block each (grid = B * Hkv * n_splits), so a single sequence with one kv head still
//   fills the GPU. With one split the block writes o and lse directly; otherwise it writes
//   its partial (o normalised by its own row sum, and its lse) in the accumulation type to
//   a workspace, and attention_decode_merge combines the splits by log-sum-exp.
// * K/V stream through shared memory with cp.async in STAGES buffers of BLOCK_K keys
//   (16-byte copies where the rows allow, COPY_BYTES; zeros past the keys and in the padding
//   columns). The launcher sizes a stage at ~16 KiB so that 3-4 blocks fit an SM with
//   STAGES - 1 tiles in flight each: ~100+ KiB in flight per SM, well above what Little's
//   law asks for at 3 TB/s (~25 KiB per SM at ~1 us latency).
// * Arithmetic runs on CUDA cores in the accumulation type (float32; float64 for float64),
//   not mma.sync: with ROWS <= 16 the products are 2 * ROWS * (D + Dv) flops per key, at
//   most 16 per byte of fp16 K/V, which the CUDA cores keep up with at HBM speed, while
//   tensor cores would need the rows padded to 16 and a separate path per dtype (float32
//   and float64 have none that is exact). One kernel thus serves every dtype.
// * Per key tile: scores (a thread per key and a few rows, or a few lanes per dot product
//   where keys x rows are fewer than the threads; Q from shared memory as broadcasts), the
//   online softmax of FlashAttention-2 (a warp per row, exact expf/exp), then O += P V (a
//   thread per CPT columns, RPT consecutive rows each, P stored key-major so a thread's
//   rows of one key are one vector load).
// * Masks are selects (a masked score becomes -inf whatever q . k was), so a NaN or Inf in
//   K or V at a masked key never reaches any row (SPEC, Errors).
//
// Keys come through `KeyValueRows`: strided rows, or under PAGED a block-table lookup per
// row (sequences.cuh), and the sequence's key count: under VARLEN batch element b is
// sequence b (padded and paged batches), tiles past its keys are never visited, rows past
// them inside the last tile are zero-filled, never loaded, and its query rows past its
// length keep no key (o = 0, lse = -inf).
//
// Compile-time configuration (NVRTC -D options): STORAGE, ACCUM, HEAD_DIM, VALUE_DIM,
// COPY_BYTES, ROWS (packed-row capacity, a power of two), BLOCK_K, STAGES, THREADS,
// LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, ALIBI, DROPOUT, VARLEN, PAGED.
#include "mma.cuh"

typedef STORAGE T;
typedef ACCUM Acc;

constexpr int kElements = 16 / sizeof(T);                      // elements per 16-byte chunk
constexpr int kHeadWidth = padded_width(HEAD_DIM, kElements);  // shared K row (zero padded)
constexpr int kValueWidth = padded_width(VALUE_DIM, kElements);
constexpr int kKPitch = kHeadWidth + kElements;  // +16 bytes: rows land in different banks
constexpr int kVPitch = kValueWidth + kElements;
constexpr int kWarps = THREADS / 32;

// Scores: score thread u (= t / kDimSplit, below) owns kKeysPerThread keys, slot + j *
// kKeySlots (slot = u % kKeySlots), for rows group + i * kScoreGroups (group = u / kKeySlots),
// and part t % kDimSplit of their dot products. Each Q load then serves
// kKeysPerThread keys, and Q rows are padded by 16 bytes (kQPitch) so that the few rows a
// warp reads at once lie in different banks: with 4 keys a thread, a warp's 16-byte loads of
// Q and K are one wavefront each (at 16 rows, D = 128: ~380 wavefronts per 32-key tile
// against ~770 with one key a thread and unpadded rows).
constexpr int kAccVector = 16 / sizeof(Acc);  // accumulators per 16 bytes
constexpr int key_blocking(int rows, int block_k, int threads) {
    // The most keys a thread (<= 4, dividing block_k) that leaves every score group a row.
    int keys = 4;
    while (keys > 1 && (block_k % keys != 0 || threads * keys / block_k > rows)) keys /= 2;
    return keys;
}
// With fewer (key, row) pairs than threads (one row per kv head, or 16 keys a tile), each
// dot product is cut into kDimSplit parts over adjacent lanes, summed by shuffles: otherwise
// most threads idle while a few run a chain of D dependent multiply-adds (at ROWS = 1, 32
// keys and D = 128, one warp of four). Parts take interleaved 16-byte chunks of the row.
constexpr int dim_split(int rows, int block_k, int threads, int chunks) {
    int parts = threads / (block_k * rows);
    parts = parts < 1 ? 1 : (parts > 8 ? 8 : parts);
    while (parts > 1 && (chunks % parts != 0 || (parts & (parts - 1)) != 0)) parts /= 2;
    return parts;
}
constexpr int kDimSplit = dim_split(ROWS, BLOCK_K, THREADS, kHeadWidth / kElements);
constexpr int kScoreThreads = THREADS / kDimSplit;  // threads that each own whole dots
constexpr int kKeysPerThread = key_blocking(ROWS, BLOCK_K, kScoreThreads);
constexpr int kKeySlots = BLOCK_K / kKeysPerThread;
constexpr int kScoreGroups = kScoreThreads / kKeySlots;
constexpr int kScoreRows = (ROWS + kScoreGroups - 1) / kScoreGroups;
constexpr int kQPitch = kHeadWidth + kAccVector;
static_assert(kScoreThreads % BLOCK_K == 0 && THREADS % 32 == 0, "whole key slots per block");
static_assert(32 % kDimSplit == 0, "a dot product's parts lie in one warp");

// O += P V: thread t owns kCpt consecutive columns and kRpt consecutive rows.
constexpr int pow2_at_least(int x) { return x <= 1 ? 1 : 2 * pow2_at_least((x + 1) / 2); }
constexpr int kValueSpan = pow2_at_least(kValueWidth < 16 ? 16 : kValueWidth);
constexpr int kCpt = kValueSpan / THREADS > 2 ? kValueSpan / THREADS : 2;
constexpr int kColumnThreads = kValueSpan / kCpt;
constexpr int kRowGroups = THREADS / kColumnThreads;
constexpr int kRpt = (ROWS + kRowGroups - 1) / kRowGroups;
static_assert(kColumnThreads * kCpt == kValueSpan && kRowGroups * kColumnThreads == THREADS,
              "output columns split evenly");
static_assert(kValueWidth % kCpt == 0, "a thread's columns lie inside or past the V tile");

// P is stored key-major, [BLOCK_K][kScorePitch]: a vector of 16 bytes of Acc per load.
// (The rows a thread reads, p_row0 + i, are all below ROWS: ROWS and kRowGroups are powers
// of two, so either kRpt * kRowGroups == ROWS or kRpt == 1 and p_row0 < ROWS is checked.)
constexpr int kScorePitch = (ROWS + kAccVector - 1) / kAccVector * kAccVector + kAccVector;

// Dynamic shared memory, in order (the launcher mirrors it: tileattn/gpu/launch_decode.py).
constexpr int kStageBytes = BLOCK_K * (kKPitch + kVPitch) * sizeof(T);
constexpr int kQBytes = ROWS * kQPitch * sizeof(Acc);
constexpr int kScoreBytes = BLOCK_K * kScorePitch * sizeof(Acc);
constexpr int kRowBytes = ROWS * (4 * sizeof(Acc) + sizeof(i64) + sizeof(u32));
constexpr int kSharedBytes = STAGES * kStageBytes + kQBytes + kScoreBytes + kRowBytes;
static_assert(STAGES >= 2, "one tile in flight while one is used");
static_assert((ROWS & (ROWS - 1)) == 0, "ROWS is a power of two");
#ifdef EXPECTED_SHARED_BYTES  // bench/experiments/compile_check_gpu.py: the launcher's mirror
static_assert(kSharedBytes == EXPECTED_SHARED_BYTES, "DecodeTiles.shared_bytes disagrees");
#endif
static_assert(kStageBytes % 16 == 0 && kQBytes % 16 == 0 && kScoreBytes % 16 == 0,
              "16-byte aligned sections");

// N consecutive elements of a shared tile as one load of N * sizeof(T) bytes (the compiler
// splits widened 16-bit elements into 2-byte loads otherwise); `p` is aligned to the size.
template <int N> struct alignas(N * sizeof(T) < 16 ? N * sizeof(T) : 16) Pack {
    T values[N];
};
template <int N> __device__ __forceinline__ void load_widened(const T* p, Acc (&out)[N]) {
    const Pack<N> pack = *reinterpret_cast<const Pack<N>*>(p);
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = static_cast<Acc>(widen(pack.values[e]));
}

// N consecutive accumulators of shared memory (P of one key), 16-byte aligned where
// N * sizeof(Acc) allows (kScorePitch and p_row0 = group * kRpt keep that alignment).
template <int N> struct alignas(N * sizeof(Acc) < 16 ? N * sizeof(Acc) : 16) AccPack {
    Acc values[N];
};

// The keys of one (batch, kv head): strided rows, or pages through the block table
// (sequences.cuh), and the sequence's key count.
struct KeyValueRows {
    KeyRows<T> k_rows;
    KeyRows<T> v_rows;
    i64 n_k;
};

// Keys [row_start, row_start + BLOCK_K) into one stage; rows past n_k become zeros without
// a load (copy_row_chunk's `row_valid`).
__device__ __forceinline__ void load_key_tile(T* k_tile, T* v_tile, const KeyValueRows& keys,
                                              i64 row_start) {
    constexpr int k_chunks = kHeadWidth / kElements, v_chunks = kValueWidth / kElements;
    const auto k_rows = keys.k_rows.for_tile(row_start, BLOCK_K);
    const auto v_rows = keys.v_rows.for_tile(row_start, BLOCK_K);
    for (int chunk = threadIdx.x; chunk < BLOCK_K * (k_chunks + v_chunks); chunk += THREADS) {
        const bool is_key = chunk < BLOCK_K * k_chunks;
        const int local = is_key ? chunk : chunk - BLOCK_K * k_chunks;
        const int chunks = is_key ? k_chunks : v_chunks;
        const int r = local / chunks, c = (local % chunks) * kElements;
        const i64 row = row_start + r;
        const bool valid = row < keys.n_k;
        if (is_key)
            copy_row_chunk<HEAD_DIM, kHeadWidth, COPY_BYTES>(
                shared_address(k_tile + r * kKPitch + c), k_rows.at(valid ? row : 0, valid),
                k_rows.fallback(), c, valid);
        else
            copy_row_chunk<VALUE_DIM, kValueWidth, COPY_BYTES>(
                shared_address(v_tile + r * kVPitch + c), v_rows.at(valid ? row : 0, valid),
                v_rows.fallback(), c, valid);
    }
}

// SPEC steps 1-4 for one score of query row `row` (its ALiBi slope `slope`) and key `col`.
__device__ __forceinline__ Acc transform_score(Acc dot, i64 row, i64 col, Acc slope, Acc scale,
                                               Acc softcap, const Band& band) {
    Acc score = dot * scale;
    if (SOFTCAP) score = softcap * tanh_acc(score / softcap);
    if (ALIBI) {
        const i64 distance = row + band.offset - col;
        score -= slope * static_cast<Acc>(distance < 0 ? -distance : distance);
    }
    if (!band_keeps<LIMIT_LEFT, LIMIT_RIGHT>(band, row, col)) score = negative_infinity<Acc>();
    return score;
}

// Whether some row of [0, n_q) masks some key of the tile at col_start by the band (its
// last key right of row 0's right edge, or its first key left of row n_q - 1's left edge).
// Keys past n_k need no care: they are zero-filled, never loaded.
__device__ __forceinline__ bool tile_crosses_band_edge(const Band& band, i64 n_q,
                                                       i64 col_start) {
    bool crosses = false;
    if (LIMIT_RIGHT) crosses = crosses || col_start + BLOCK_K - 1 > band.offset + band.right;
    if (LIMIT_LEFT) crosses = crosses || col_start < n_q - 1 + band.offset - band.left;
    return crosses;
}

// The sign bit by hand: NVRTC has no header for signbit.
__device__ __forceinline__ bool sign_bit(float x) { return __float_as_uint(x) >> 31; }
__device__ __forceinline__ bool sign_bit(double x) { return __double_as_longlong(x) < 0; }

// acc[i][j] += P[c][i] V[c][j] over the tile's keys; `p` points at this thread's first row
// of P (key-major), `v` at its first column of the V tile. With Select, a masked entry
// (-0.0) adds nothing even where V is NaN or Inf; a kept one follows IEEE (0 x Inf = NaN,
// as in the golden model).
template <bool Select>
__device__ __forceinline__ void accumulate_pv(Acc (&acc)[kRpt][kCpt], const Acc* p,
                                              const T* v) {
#pragma unroll 4
    for (int c = 0; c < BLOCK_K; ++c) {
        Acc value[kCpt];
        load_widened(v + c * kVPitch, value);
        const AccPack<kRpt> p_key = *reinterpret_cast<const AccPack<kRpt>*>(p + c * kScorePitch);
#pragma unroll
        for (int i = 0; i < kRpt; ++i) {
            const Acc probability = p_key.values[i];
            const bool masked = Select && sign_bit(probability);
#pragma unroll
            for (int j = 0; j < kCpt; ++j)
                acc[i][j] = masked ? acc[i][j] : acc[i][j] + probability * value[j];
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) attention_decode(
    const T* q, const T* k, const T* v, T* o, Acc* lse, Acc* partial_o, Acc* partial_lse,
    const double* alibi_slopes, i64 n_q, i64 n_k, int n_q_heads, int group_size, int n_splits,
    i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
    i64 o_sb, i64 o_sh, i64 o_sn, Acc scale, Acc softcap, i64 band_offset, i64 window_left,
    i64 window_right,
    u32 dropout_key, u32 dropout_threshold, Acc dropout_scale, u32 dropout_row0,
    u32 dropout_col0, SEQUENCE_PARAMETERS) {
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    // STAGES x (K tile [BLOCK_K][kKPitch], V tile [BLOCK_K][kVPitch]), then Q, P, row state.
    T* stages = reinterpret_cast<T*>(shared_bytes);
    Acc* q_tile = reinterpret_cast<Acc*>(shared_bytes + STAGES * kStageBytes);  // [ROWS][kQPitch]
    Acc* scores = q_tile + ROWS * kQPitch;          // [BLOCK_K][kScorePitch], key-major
    Acc* row_max = scores + BLOCK_K * kScorePitch;  // [ROWS] each
    Acc* row_sum = row_max + ROWS;
    Acc* row_rescale = row_sum + ROWS;
    Acc* row_slope = row_rescale + ROWS;
    i64* row_query = reinterpret_cast<i64*>(row_slope + ROWS);  // query row of packed row r
    u32* row_state = reinterpret_cast<u32*>(row_query + ROWS);  // dropout hash state
    {  // the launcher's shared-memory size must cover this layout
        u32 provided;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(provided));
        if (provided < kSharedBytes) __trap();
    }

    const int all_rows = static_cast<int>(group_size * n_q);  // packed rows of a kv head
    const int row_groups = (all_rows + ROWS - 1) / ROWS;
    const i64 bkv = blockIdx.x / n_splits / row_groups;  // flat (batch, kv head)
    const int split = static_cast<int>(blockIdx.x % n_splits);
    const int first_row = static_cast<int>(blockIdx.x / n_splits % row_groups) * ROWS;
    const int n_kv_heads = n_q_heads / group_size;
    const i64 batch = bkv / n_kv_heads;
    const int kv_head = static_cast<int>(bkv % n_kv_heads);
    // This block's packed rows first_row + [0, rows): row r below is packed row first_row + r.
    const int rows = min(ROWS, all_rows - first_row);
    const i64 out_row0 = bkv * all_rows + first_row;  // flat (b, h, i) of its row 0 in o, lse
    // Rows of o and lse over the whole grid (B Hq Nq): the partials' split stride.
    const i64 grid_rows = (gridDim.x / n_splits / row_groups) * static_cast<i64>(all_rows);
    // A padded or paged batch: batch element b is sequence b, whose rows past seq_rows are
    // padding (they keep no key: o = 0, lse = -inf) and whose keys number n_k there.
    const SequenceTables tables = SEQUENCE_TABLES;
    i64 seq_rows = n_q, seq_keys = n_k, seq_band = band_offset;
    if (VARLEN) {
        const Sequence sequence = sequence_at(tables.descriptors, batch);
        seq_rows = sequence.rows;
        seq_keys = sequence.keys;
        seq_band = sequence.band + band_offset;
    }
    const Band band{seq_band, window_left, window_right};
    const KeyValueRows keys{key_rows(k, batch, kv_head, k_sb, k_sh, k_sn, 0, tables),
                            key_rows(v, batch, kv_head, v_sb, v_sh, v_sn, 0, tables), seq_keys};

    // Per packed row: query row, ALiBi slope, dropout state; running max and sum.
    for (int r = threadIdx.x; r < ROWS; r += THREADS) {
        const int packed = first_row + r;
        const i64 head = static_cast<i64>(kv_head) * group_size + (r < rows ? packed / n_q : 0);
        const i64 bh = batch * n_q_heads + head;
        const i64 query_row = r < rows ? packed % n_q : 0;
        row_query[r] = query_row;
        row_slope[r] = ALIBI ? static_cast<Acc>(alibi_slopes[bh]) : Acc(0);
        row_state[r] = DROPOUT ? dropout_row_state(dropout_key, static_cast<u32>(bh),
                                                   static_cast<u32>(query_row) + dropout_row0)
                               : 0u;
        row_max[r] = negative_infinity<Acc>();
        row_sum[r] = 0;
    }
    // Q rows, widened; zeros past the rows in use and past D.
    for (int e = threadIdx.x; e < ROWS * kHeadWidth; e += THREADS) {
        const int r = e / kHeadWidth, d = e % kHeadWidth;
        Acc value = 0;
        if (r < rows && d < HEAD_DIM) {
            const int packed = first_row + r;
            const i64 head = static_cast<i64>(kv_head) * group_size + packed / n_q;
            value = static_cast<Acc>(
                widen(q[batch * q_sb + head * q_sh + (packed % n_q) * q_sn + d]));
        }
        q_tile[r * kQPitch + d] = value;
    }

    // This split's key tiles: the band's tiles for rows [0, seq_rows) cut into n_splits ranges.
    i64 tile_begin, tile_end;
    key_tile_range<LIMIT_LEFT, LIMIT_RIGHT>(band, 0, seq_rows, keys.n_k, BLOCK_K, &tile_begin,
                                            &tile_end);
    if (VARLEN && seq_rows == 0) tile_end = tile_begin;
    const i64 n_tiles = tile_end - tile_begin;
    const i64 my_begin = tile_begin + n_tiles * split / n_splits;
    const i64 my_end = tile_begin + n_tiles * (split + 1) / n_splits;

    const int p_row_group = threadIdx.x / kColumnThreads;
    const int p_col0 = (threadIdx.x % kColumnThreads) * kCpt;
    const int p_row0 = p_row_group * kRpt;
    Acc acc[kRpt][kCpt];
#pragma unroll
    for (int i = 0; i < kRpt; ++i)
#pragma unroll
        for (int j = 0; j < kCpt; ++j) acc[i][j] = 0;

    // Prologue: STAGES - 1 tiles in flight (a group is committed even when empty, so the
    // wait below always counts the same number of groups).
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (my_begin + s < my_end) {
            T* stage = stages + s * (kStageBytes / sizeof(T));
            load_key_tile(stage, stage + BLOCK_K * kKPitch, keys, (my_begin + s) * BLOCK_K);
        }
        commit_copies();
    }

    for (i64 tile = my_begin; tile < my_end; ++tile) {
        const int slot = static_cast<int>((tile - my_begin) % STAGES);
        const T* k_tile = stages + slot * (kStageBytes / sizeof(T));
        const T* v_tile = k_tile + BLOCK_K * kKPitch;
        wait_copies<STAGES - 2>();
        __syncthreads();  // this tile landed for all; the stage refilled below is free
        {
            const i64 next = tile + STAGES - 1;
            if (next < my_end) {
                T* stage = stages + static_cast<int>((next - my_begin) % STAGES) *
                                        (kStageBytes / sizeof(T));
                load_key_tile(stage, stage + BLOCK_K * kKPitch, keys, next * BLOCK_K);
            }
            commit_copies();
        }
        const i64 col_start = tile * BLOCK_K;

        // Scores: kKeysPerThread keys x kScoreRows rows a thread, Q and K from shared memory.
        {
            const int part = threadIdx.x % kDimSplit, score_thread = threadIdx.x / kDimSplit;
            const int slot = score_thread % kKeySlots, group = score_thread / kKeySlots;
            Acc dots[kKeysPerThread][kScoreRows];
#pragma unroll
            for (int j = 0; j < kKeysPerThread; ++j)
#pragma unroll
                for (int i = 0; i < kScoreRows; ++i) dots[j][i] = 0;
#pragma unroll 2
            for (int d0 = part * kElements; d0 < kHeadWidth; d0 += kDimSplit * kElements) {
                Acc key_part[kKeysPerThread][kElements];
#pragma unroll
                for (int j = 0; j < kKeysPerThread; ++j)
                    load_widened(k_tile + (slot + j * kKeySlots) * kKPitch + d0, key_part[j]);
#pragma unroll
                for (int i = 0; i < kScoreRows; ++i) {
                    const int r = group + i * kScoreGroups;
                    if (kScoreRows * kScoreGroups == ROWS || r < ROWS) {
                        const AccPack<kElements> q_part =
                            *reinterpret_cast<const AccPack<kElements>*>(q_tile + r * kQPitch + d0);
#pragma unroll
                        for (int j = 0; j < kKeysPerThread; ++j)
#pragma unroll
                            for (int e = 0; e < kElements; ++e)
                                dots[j][i] += q_part.values[e] * key_part[j][e];
                    }
                }
            }
            if (kDimSplit > 1) {
#pragma unroll
                for (int j = 0; j < kKeysPerThread; ++j)
#pragma unroll
                    for (int i = 0; i < kScoreRows; ++i)
#pragma unroll
                        for (int lanes = kDimSplit / 2; lanes > 0; lanes /= 2)
                            dots[j][i] += __shfl_xor_sync(0xffffffffu, dots[j][i], lanes);
            }
#pragma unroll
            for (int j = 0; j < kKeysPerThread && part == 0; ++j) {
                const int c = slot + j * kKeySlots;
                const i64 col = col_start + c;
#pragma unroll
                for (int i = 0; i < kScoreRows; ++i) {
                    const int r = group + i * kScoreGroups;
                    if (r < ROWS) {
                        Acc score = negative_infinity<Acc>();
                        if (r < rows && col < keys.n_k && (!VARLEN || row_query[r] < seq_rows))
                            score = transform_score(dots[j][i], row_query[r], col, row_slope[r],
                                                    scale, softcap, band);
                        scores[c * kScorePitch + r] = score;
                    }
                }
            }
        }
        __syncthreads();

        // Online softmax, a warp per row (FlashAttention-2 Algorithm 1). fmax: a NaN score
        // does not win the max; it reaches the row sum through exp(NaN) instead.
        for (int r = threadIdx.x / 32; r < ROWS; r += kWarps) {
            const int lane = threadIdx.x % 32;
            Acc tile_max = negative_infinity<Acc>();
            for (int c = lane; c < BLOCK_K; c += 32)
                tile_max = fmax(tile_max, scores[c * kScorePitch + r]);
            tile_max = warp_max(tile_max);
            const Acc old_max = row_max[r];
            const Acc new_max = fmax(old_max, tile_max);
            // A row with nothing kept yet has max -inf: subtract 0 instead (no inf - inf).
            const Acc safe_max = new_max == negative_infinity<Acc>() ? Acc(0) : new_max;
            Acc tile_sum = 0;
            for (int c = lane; c < BLOCK_K; c += 32) {
                const Acc score = scores[c * kScorePitch + r];
                const Acc p = exp_acc(score - safe_max);
                tile_sum += p;
                Acc p_used = p;  // dropout thins the P that multiplies V, not the row sum
                if (DROPOUT)
                    p_used = dropout_keeps(row_state[r],
                                           static_cast<u32>(col_start + c) + dropout_col0,
                                           dropout_threshold)
                                 ? p * dropout_scale
                                 : Acc(0);
                // -0.0 marks a masked key for the select in accumulate_pv (a kept key's
                // probability is never -0.0: exp gives +0 at the least).
                scores[c * kScorePitch + r] =
                    score == negative_infinity<Acc>() ? -Acc(0) : p_used;
            }
            tile_sum = warp_sum(tile_sum);
            __syncwarp();  // every lane read row_max[r] before lane 0 writes it
            if (lane == 0) {
                const Acc rescale = exp_acc(old_max - safe_max);
                row_sum[r] = row_sum[r] * rescale + tile_sum;
                row_max[r] = new_max;
                row_rescale[r] = rescale;
            }
        }
        __syncthreads();

        // O += P V: kRpt rows x kCpt columns a thread; P of one key is one vector load.
        // Tiles across a band edge hold masked keys whose V may be NaN or Inf: there a
        // masked entry (marked -0.0 above) is skipped by a select, never multiplied.
        if (p_row0 < ROWS && p_col0 < kValueWidth) {
#pragma unroll
            for (int i = 0; i < kRpt; ++i) {
                const Acc rescale = row_rescale[p_row0 + i];
#pragma unroll
                for (int j = 0; j < kCpt; ++j) acc[i][j] *= rescale;
            }
            if (tile_crosses_band_edge(band, seq_rows, col_start))
                accumulate_pv<true>(acc, scores + p_row0, v_tile + p_col0);
            else
                accumulate_pv<false>(acc, scores + p_row0, v_tile + p_col0);
        }
    }
    wait_copies<0>();
    __syncthreads();  // row_sum/row_max final (also when this split has no tile)

    // Deferred normalisation (FlashAttention-2 section 3.1.1). row_sum == 0: no key kept
    // here (o = 0, lse = -inf); a NaN row_sum is not 0, so NaN reaches o and lse.
    const bool direct = n_splits == 1;
    if (p_row0 < ROWS && p_col0 < VALUE_DIM) {
#pragma unroll
        for (int i = 0; i < kRpt; ++i) {
            const int r = p_row0 + i;
            if (r >= rows) continue;
            const Acc total = row_sum[r];
            const i64 out_row = out_row0 + r;
            const i64 o_offset = !STRIDED_OUT ? out_row * VALUE_DIM
                                 : direct     ? packed_row_offset(batch, kv_head, group_size,
                                                                  static_cast<int>(n_q),
                                                                  first_row + r,
                                                                  {o_sb, o_sh, o_sn})
                                              : 0;
#pragma unroll
            for (int j = 0; j < kCpt; ++j) {
                const int d = p_col0 + j;
                if (d >= VALUE_DIM) continue;
                const Acc value = total == Acc(0) ? Acc(0) : acc[i][j] / total;
                if (direct)
                    o[o_offset + d] = narrow<T>(value);
                else
                    partial_o[(split * grid_rows + out_row) * VALUE_DIM + d] = value;
            }
        }
    }
    for (int r = threadIdx.x; r < rows; r += THREADS) {
        const Acc total = row_sum[r];
        const Acc value = total == Acc(0) ? negative_infinity<Acc>() : row_max[r] + log_acc(total);
        if (direct)
            lse[out_row0 + r] = value;
        else
            partial_lse[split * grid_rows + out_row0 + r] = value;
    }
}

// Combines the splits of one output row: with m the largest split lse,
// w_s = exp(lse_s - m), o = sum_s w_s o_s / sum_s w_s and lse = m + log(sum_s w_s). Every
// split -inf (no key kept anywhere): o = 0, lse = -inf. A NaN split lse is passed over by
// fmax and then makes the sum NaN, so NaN reaches o and lse.
// A block per (row, 32 columns): a single sequence of one kv head has only ROWS rows but
// hundreds of splits, whose partials (splits x Dv floats a row) a block per row would read
// through a handful of SMs. Lane = column; the MERGE_WARPS warps take every MERGE_WARPS-th
// split, so each warp reads 128 contiguous bytes a split. The pass is a few dependent reads
// long, so its latency is the cost (a step of ~100 us paid ~6-8 us for it, NOTES-gpu v32):
// every lse is read once (kept in shared memory up to kMergeKeptSplits splits), and each
// lane loads its first kMergeEarly partial values before the weights are known, so that
// those loads overlap the lse reads'; 16 warps, not 8, halve each warp's chain of reads
// (NOTES-gpu v33, H200: 396 splits 54.3 -> 49.5 us a step, 264 splits 54.9 -> 52.4, the
// same at <= 66; 32 warps no better). Sums run in a fixed order (deterministic).
#ifndef MERGE_WARPS
#define MERGE_WARPS 16
#endif
constexpr int kMergeWarps = MERGE_WARPS;  // launch_decode.py's MERGE_WARPS
constexpr int kMergeThreads = kMergeWarps * 32;
constexpr int kMergeKeptSplits = 512;  // tiles.DECODE_MAX_SPLITS; more are read twice
constexpr int kMergeEarly = 8;
extern "C" __global__ void __launch_bounds__(kMergeThreads) attention_decode_merge(
    const Acc* partial_o, const Acc* partial_lse, T* o, Acc* lse, i64 n_rows, int n_splits,
    int n_q_heads, i64 n_q, i64 o_sb, i64 o_sh, i64 o_sn) {
    __shared__ Acc weights[kMergeKeptSplits];
    __shared__ Acc warp_max_values[kMergeWarps], warp_totals[kMergeWarps];
    __shared__ Acc warp_sums[kMergeWarps][32];
    const i64 row = blockIdx.x;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int d = blockIdx.y * 32 + lane;
    const auto partial = [&](int s) { return partial_o[(s * n_rows + row) * VALUE_DIM + d]; };
    Acc early[kMergeEarly];
#pragma unroll
    for (int j = 0; j < kMergeEarly; ++j) {
        const int s = warp + j * kMergeWarps;
        early[j] = s < n_splits && d < VALUE_DIM ? partial(s) : Acc(0);
    }
    Acc largest = negative_infinity<Acc>();
    for (int s = threadIdx.x; s < n_splits; s += kMergeThreads) {
        const Acc value = partial_lse[s * n_rows + row];
        if (s < kMergeKeptSplits) weights[s] = value;
        largest = fmax(largest, value);
    }
    largest = warp_max(largest);
    if (lane == 0) warp_max_values[warp] = largest;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kMergeWarps; ++w) largest = fmax(largest, warp_max_values[w]);
    const Acc safe_max = largest == negative_infinity<Acc>() ? Acc(0) : largest;
    const auto weight_of = [&](int s) {  // splits past the kept ones: their lse read again
        return exp_acc(partial_lse[s * n_rows + row] - safe_max);
    };
    Acc total = 0;
    for (int s = threadIdx.x; s < n_splits; s += kMergeThreads) {
        const Acc weight = s < kMergeKeptSplits ? exp_acc(weights[s] - safe_max) : weight_of(s);
        if (s < kMergeKeptSplits) weights[s] = weight;
        total += weight;
    }
    total = warp_sum(total);
    if (lane == 0) warp_totals[warp] = total;
    __syncthreads();
    total = 0;
#pragma unroll
    for (int w = 0; w < kMergeWarps; ++w) total += warp_totals[w];
    Acc sum = 0;
    if (d < VALUE_DIM) {
#pragma unroll
        for (int j = 0; j < kMergeEarly; ++j) {
            const int s = warp + j * kMergeWarps;
            if (s < n_splits) sum += (s < kMergeKeptSplits ? weights[s] : weight_of(s)) * early[j];
        }
#pragma unroll 4
        for (int s = warp + kMergeEarly * kMergeWarps; s < n_splits; s += kMergeWarps)
            sum += (s < kMergeKeptSplits ? weights[s] : weight_of(s)) * partial(s);
    }
    warp_sums[warp][lane] = sum;
    __syncthreads();
    if (warp == 0 && d < VALUE_DIM) {
        Acc row_sum = 0;
#pragma unroll
        for (int w = 0; w < kMergeWarps; ++w) row_sum += warp_sums[w][lane];
        o[flat_row_offset(row, n_q_heads, n_q, {o_sb, o_sh, o_sn}) + d] =
            narrow<T>(total == Acc(0) ? Acc(0) : row_sum / total);
    }
    if (blockIdx.y == 0 && threadIdx.x == 0)
        lse[row] = total == Acc(0) ? negative_infinity<Acc>() : safe_max + log_acc(total);
}

// The same merge, a warp per row and 8 rows a block, for calls of many rows (speculative or
// GQA rows of a batch: B8 H32/8 Nq8 is 2048 rows at 2 splits), where a block of 16 warps per
// (row, 32 columns) leaves most warps without a split and its thousands of short blocks run
// as dozens of waves (H200, B8 H32/8 Nq8 Nk4k D256: a 183 us step took 80 with this merge,
// NOTES-gpu v55). Lane c takes columns c, c + 32, ... and adds the splits' partials in split
// order (deterministic), four splits' loads in flight at a time; up to 32 splits, lane s
// holds split s's weight, beyond that each split's weight is formed again from its lse.
constexpr int kMergeRowsPerBlock = 8;
constexpr int kMergeLaneColumns = (VALUE_DIM + 31) / 32;
extern "C" __global__ void __launch_bounds__(32 * kMergeRowsPerBlock)
attention_decode_merge_rows(const Acc* partial_o, const Acc* partial_lse, T* o, Acc* lse,
                            i64 n_rows, int n_splits, int n_q_heads, i64 n_q, i64 o_sb,
                            i64 o_sh, i64 o_sn) {
    const int lane = threadIdx.x % 32;
    const i64 row = static_cast<i64>(blockIdx.x) * kMergeRowsPerBlock + threadIdx.x / 32;
    if (row >= n_rows) return;  // whole warps leave: the shuffles below see every lane
    const auto lse_of = [&](int s) { return partial_lse[s * n_rows + row]; };
    const Acc my_lse = lane < n_splits ? lse_of(lane) : negative_infinity<Acc>();
    Acc largest = my_lse;
    for (int s = lane + 32; s < n_splits; s += 32) largest = fmax(largest, lse_of(s));
    largest = warp_max(largest);
    const Acc safe_max = largest == negative_infinity<Acc>() ? Acc(0) : largest;
    const Acc my_weight = lane < n_splits ? exp_acc(my_lse - safe_max) : Acc(0);
    Acc total = my_weight;
    for (int s = lane + 32; s < n_splits; s += 32) total += exp_acc(lse_of(s) - safe_max);
    total = warp_sum(total);
    const bool weights_in_lanes = n_splits <= 32;
    Acc sum[kMergeLaneColumns];
#pragma unroll
    for (int c = 0; c < kMergeLaneColumns; ++c) sum[c] = 0;
#pragma unroll 4
    for (int s = 0; s < n_splits; ++s) {
        const Acc weight = weights_in_lanes ? __shfl_sync(0xffffffffu, my_weight, s)
                                            : exp_acc(lse_of(s) - safe_max);
        const Acc* part = partial_o + (s * n_rows + row) * VALUE_DIM;
#pragma unroll
        for (int c = 0; c < kMergeLaneColumns; ++c) {
            const int d = lane + 32 * c;
            if (d < VALUE_DIM) sum[c] += weight * part[d];
        }
    }
    T* out = o + flat_row_offset(row, n_q_heads, n_q, {o_sb, o_sh, o_sn});
#pragma unroll
    for (int c = 0; c < kMergeLaneColumns; ++c) {
        const int d = lane + 32 * c;
        if (d < VALUE_DIM) out[d] = narrow<T>(total == Acc(0) ? Acc(0) : sum[c] / total);
    }
    if (lane == 0)
        lse[row] = total == Acc(0) ? negative_infinity<Acc>() : safe_max + log_acc(total);
}
