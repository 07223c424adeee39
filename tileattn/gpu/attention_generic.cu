// CUDA-core attention, forward and backward, for every dtype and head dim up to 256.
//
// The tensor-core forward (attention_mma_forward.cu) covers the float16/bfloat16 hot path;
// this file is the exact fallback: float32/float64 (accumulated in the input's precision
// class, no TF32), head dims that the tensor-core tiles do not fit, and the backward.
// It follows tiled_forward / tiled_backward of tileattn/reference.py step by step.
//
// Compile-time configuration (NVRTC -D options, one module per configuration):
//   STORAGE, ACCUM           storage type of q/k/v/o and the accumulation type
//   HEAD_DIM_PAD, VALUE_DIM_PAD   D and Dv rounded up to a power of two >= 16; tiles are
//                            zero-padded, so the padding adds nothing to any dot product
//   BLOCK_Q, BLOCK_K         tile capacity; the run-time block_q/block_k (<= capacity) are
//                            the caller's tile sizes, so an override costs no new compile
//   THREADS                  threads per block
//   LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, ALIBI, DROPOUT   0/1 option switches
//   VARLEN, PAGED                                      variable-length (both directions)
//                                                      and paged (forward) calls
//                                                      (sequences.cuh)
#include "sequences.cuh"

template <typename TStorage, typename TAcc, int HeadDimPad, int ValueDimPad, int BlockQ,
          int BlockK, int Threads, bool LimitLeft, bool LimitRight, bool Softcap, bool Alibi,
          bool Dropout>
struct GenericConfig {
    typedef TStorage T;
    typedef TAcc Acc;
    static constexpr int head_dim_pad = HeadDimPad, value_dim_pad = ValueDimPad;
    static constexpr int block_q = BlockQ, block_k = BlockK, threads = Threads;
    static constexpr int warps = Threads / 32;
    static constexpr bool limit_left = LimitLeft, limit_right = LimitRight;
    static constexpr bool softcap = Softcap, alibi = Alibi, dropout = Dropout;
    // Row pitches of the shared tiles: one extra element so that threads walking down a
    // column of a tile hit different banks.
    static constexpr int head_pitch = HeadDimPad + 1, value_pitch = ValueDimPad + 1;
    static constexpr int score_pitch = BlockK + 1;
    static_assert((BlockQ * BlockK) % Threads == 0, "score tile must split evenly");
    static_assert((BlockQ * ValueDimPad) % Threads == 0, "output tile must split evenly");
    static_assert((BlockK * HeadDimPad) % Threads == 0, "dK tile must split evenly");
    static_assert((BlockK * ValueDimPad) % Threads == 0, "dV tile must split evenly");
    static_assert((BlockQ * HeadDimPad) % Threads == 0, "dQ tile must split evenly");
};

typedef GenericConfig<STORAGE, ACCUM, HEAD_DIM_PAD, VALUE_DIM_PAD, BLOCK_Q, BLOCK_K, THREADS,
                      LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, ALIBI, DROPOUT>
    Config;

// The run-time options every kernel of this file reads.
template <typename Acc> struct ScoreOptions {
    Acc scale;
    Acc softcap;
    Band band;
    u32 dropout_key;
    u32 dropout_threshold;
    Acc dropout_scale;  // 1 / (1 - dropout_p)
    u32 dropout_row0;   // global position of row 0 and key 0 (a block of a longer sequence)
    u32 dropout_col0;
};

struct HeadStrides {
    i64 batch, head, row, col;
};

// The dynamic shared memory the host allocated must cover this kernel's layout; the
// host mirrors the layout in tileattn/gpu/_launch.py, and this check keeps the two honest.
__device__ __forceinline__ void require_shared_bytes(u64 needed) {
    u32 provided;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(provided));
    if (provided < needed) __trap();
}

// Rows [row_start, row_start + rows) and columns [0, cols) of one head into a
// tile[Rows][Pitch] of Acc; everything else in the tile becomes 0 (so padded rows and
// columns contribute nothing and never carry NaN from uninitialised memory). Returns
// whether this thread loaded a non-finite element (x - x is 0 for finite x only): the
// caller ORs it over the block with the barrier that follows the load, for free.
template <class C, int Rows, int Pad, class Source>
__device__ __forceinline__ bool load_rows(typename C::Acc* tile, const Source& source,
                                          i64 col_stride, i64 row_start, int rows, int cols) {
    bool non_finite = false;
    const auto tile_rows = source.for_tile(row_start, Rows);
    for (int element = threadIdx.x; element < Rows * Pad; element += C::threads) {
        const int r = element / Pad, c = element % Pad;
        typename C::Acc value = 0;
        if (r < rows && c < cols)
            value = static_cast<typename C::Acc>(
                widen(tile_rows.at(row_start + r, true)[c * col_stride]));
        non_finite |= !(value - value == typename C::Acc(0));
        tile[r * (Pad + 1) + c] = value;
    }
    return non_finite;
}

// The same for rows of one head with `strides`.
template <class C, int Rows, int Pad>
__device__ __forceinline__ bool load_tile(typename C::Acc* tile, const typename C::T* head,
                                          const HeadStrides& strides, i64 row_start, int rows,
                                          int cols) {
    return load_rows<C, Rows, Pad>(tile, StridedRows<typename C::T>{head, strides.row},
                                   strides.col, row_start, rows, cols);
}

// The score tile is split so that a thread owns one column c = threadIdx.x % block_k and
// rows r0 + i * row_step: every thread of a warp reads the same row of the tall operand
// (a broadcast) and keeps its column's element in a register for all its rows, one
// shared load per multiply-add instead of two.
template <class C> struct ScoreSlots {
    static constexpr int count = C::block_q * C::block_k / C::threads;
    static constexpr int row_step = C::threads / C::block_k;
    static_assert(C::threads % C::block_k == 0, "a thread keeps one score column");
};

// dots[i] = rows[(r0 + i * row_step)] . column_row over Pad elements.
template <class C, int Pad, int Pitch>
__device__ __forceinline__ void dot_slots(const typename C::Acc* rows,
                                          const typename C::Acc* column_row, int r0,
                                          typename C::Acc* dots) {
    constexpr int count = ScoreSlots<C>::count, row_step = ScoreSlots<C>::row_step;
#pragma unroll
    for (int i = 0; i < count; ++i) dots[i] = 0;
#pragma unroll 4
    for (int d = 0; d < Pad; ++d) {
        const typename C::Acc element = column_row[d];
#pragma unroll
        for (int i = 0; i < count; ++i) dots[i] += rows[(r0 + i * row_step) * Pitch + d] * element;
    }
}

// Accumulator slots of a [Rows][Pad] product tile: slot i of a thread is element
// threadIdx.x + i * threads in row-major order, as the loads and stores index it. Where
// threads % Pad == 0 a thread keeps one column over rows threads / Pad apart; where
// Pad % threads == 0 (head dims above 256) Pad / threads columns of every row.
template <class C, int Pad>
struct ProductSlots {
    static_assert(C::threads % Pad == 0 || Pad % C::threads == 0,
                  "a thread keeps whole columns of the product tile");
    static constexpr int columns = Pad > C::threads ? Pad / C::threads : 1;
    static constexpr int row_step = Pad > C::threads ? 1 : C::threads / Pad;
    __device__ __forceinline__ static int row(int slot) {
        return threadIdx.x / Pad + (slot / columns) * row_step;
    }
    __device__ __forceinline__ static int column(int slot) {
        return threadIdx.x % Pad + (slot % columns) * C::threads;
    }
};

// acc[i] += sum_j a[row_i][j] * b[j][column_i] over j < Inner for the slots above, with a
// read at a[row * a_pitch + j * a_inner_stride] and b at b[j * b_pitch + column].
template <class C, int Rows, int Pad, int Inner>
__device__ __forceinline__ void accumulate_product(typename C::Acc* acc,
                                                   const typename C::Acc* a, int a_pitch,
                                                   int a_inner_stride,
                                                   const typename C::Acc* b, int b_pitch) {
    typedef ProductSlots<C, Pad> Slots;
    constexpr int count = Rows * Pad / C::threads;
#pragma unroll 4
    for (int j = 0; j < Inner; ++j) {
        typename C::Acc elements[Slots::columns];
#pragma unroll
        for (int c = 0; c < Slots::columns; ++c) elements[c] = b[j * b_pitch + Slots::column(c)];
#pragma unroll
        for (int i = 0; i < count; ++i)
            acc[i] += a[Slots::row(i) * a_pitch + j * a_inner_stride] *
                      elements[i % Slots::columns];
    }
}

// accumulate_product restricted to the (query, key) pairs the band keeps: SPEC says a
// masked entry contributes nothing, not 0 x NaN, and the weights' masked entries are 0
// while the other operand may hold NaN or inf there. Taken only where the streamed or
// owned operand of the product holds a non-finite element (a flag from load_tile), so
// finite inputs keep the unpredicated loop. RowsAreKeys: the product's rows are keys and
// its inner index queries (dK, dV); otherwise rows are queries and the inner index keys.
// Rows and keys past the sequence ends need no test: their tile rows are zero and their
// weights 0.
template <class C, int Rows, int Pad, int Inner, bool RowsAreKeys>
__device__ __forceinline__ void accumulate_kept_product(
    typename C::Acc* acc, const typename C::Acc* a, int a_pitch, int a_inner_stride,
    const typename C::Acc* b, int b_pitch, const Band& band, i64 row_start, i64 col_start) {
    typedef ProductSlots<C, Pad> Slots;
    constexpr int count = Rows * Pad / C::threads;
#pragma unroll 1
    for (int j = 0; j < Inner; ++j) {
        typename C::Acc elements[Slots::columns];
#pragma unroll
        for (int c = 0; c < Slots::columns; ++c) elements[c] = b[j * b_pitch + Slots::column(c)];
#pragma unroll
        for (int i = 0; i < count; ++i) {
            const int row = Slots::row(i);
            const i64 query = RowsAreKeys ? row_start + j : row_start + row;
            const i64 key = RowsAreKeys ? col_start + row : col_start + j;
            if (band_keeps<C::limit_left, C::limit_right>(band, query, key))
                acc[i] += a[row * a_pitch + j * a_inner_stride] * elements[i % Slots::columns];
        }
    }
}

// SPEC steps 1-4 for one score: scale, softcap, ALiBi, mask (a select, not an additive
// bias, so a NaN at a masked position vanishes). Also returns d(score)/d(raw) of the
// softcap for the backward.
template <class C>
__device__ __forceinline__ typename C::Acc transform_score(
    typename C::Acc dot, i64 row, i64 col, typename C::Acc alibi_slope,
    const ScoreOptions<typename C::Acc>& options, typename C::Acc* softcap_grad) {
    typedef typename C::Acc Acc;
    Acc score = dot * options.scale;
    if (C::softcap) {
        const Acc capped = tanh_acc(score / options.softcap);
        score = options.softcap * capped;
        *softcap_grad = Acc(1) - capped * capped;
    }
    if (C::alibi) {
        const i64 distance = row + options.band.offset - col;
        score -= alibi_slope * static_cast<Acc>(distance < 0 ? -distance : distance);
    }
    if (!band_keeps<C::limit_left, C::limit_right>(options.band, row, col))
        score = negative_infinity<Acc>();
    return score;
}

template <class C>
__device__ __forceinline__ typename C::Acc alibi_slope_of(const double* slopes, i64 bh) {
    return C::alibi ? static_cast<typename C::Acc>(slopes[bh]) : typename C::Acc(0);
}

// ================================================================== forward
// One block per (batch, head, query tile); key tiles stream through shared memory with
// the online softmax of FlashAttention-2 (Algorithm 1): running row max and row sum,
// rescaling of the accumulator, one division at the end.

template <class C>
__device__ void forward_tile(const typename C::T* q, const typename C::T* k,
                             const typename C::T* v, typename C::T* o, typename C::Acc* lse,
                             const double* alibi_slopes, i64 n_q_total, i64 n_k_total,
                             int n_q_heads, int group_size, int head_dim, int value_dim,
                             int block_q, int block_k, HeadStrides q_strides,
                             HeadStrides k_strides, HeadStrides v_strides,
                             OutputStrides o_strides, ScoreOptions<typename C::Acc> options,
                             const SequenceTables& tables) {
    typedef typename C::Acc Acc;
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    Acc* q_tile = reinterpret_cast<Acc*>(shared_bytes);         // [block_q][head_pitch]
    Acc* k_tile = q_tile + C::block_q * C::head_pitch;          // [block_k][head_pitch]
    Acc* v_tile = k_tile + C::block_k * C::head_pitch;          // [block_k][value_pitch]
    Acc* scores = v_tile + C::block_k * C::value_pitch;         // [block_q][score_pitch]
    Acc* row_max = scores + C::block_q * C::score_pitch;        // [block_q]
    Acc* row_sum = row_max + C::block_q;                        // [block_q]
    Acc* row_rescale = row_sum + C::block_q;                    // [block_q]
    require_shared_bytes(sizeof(Acc) * (row_rescale + C::block_q - q_tile));

    const QueryBlock owned = query_block(block_q, n_q_total, n_k_total, options.band.offset, n_q_heads,
                                         group_size, tables);
    if (tile_past_rows(owned)) return;
    const i64 bh = owned.bh, n_q = owned.n_q, n_k = owned.n_k;
    options.band.offset = owned.band_offset;
    const typename C::T* q_head = q + owned.batch * q_strides.batch +
                                  owned.head * q_strides.head + owned.row_base * q_strides.row;
    const KeyRows<typename C::T> k_head =
        key_rows(k, owned.batch, owned.kv_head, k_strides.batch, k_strides.head, k_strides.row,
                 owned.key_base, tables);
    const KeyRows<typename C::T> v_head =
        key_rows(v, owned.batch, owned.kv_head, v_strides.batch, v_strides.head, v_strides.row,
                 owned.key_base, tables);
    const i64 row_start = owned.row_start;
    const int rows = static_cast<int>(min(static_cast<i64>(block_q), n_q - row_start));
    const Acc slope = alibi_slope_of<C>(alibi_slopes, bh);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    load_tile<C, C::block_q, C::head_dim_pad>(q_tile, q_head, q_strides, row_start, rows,
                                              head_dim);
    for (int r = threadIdx.x; r < C::block_q; r += C::threads) {
        row_max[r] = negative_infinity<Acc>();
        row_sum[r] = 0;
    }
    constexpr int outputs_per_thread = C::block_q * C::value_dim_pad / C::threads;
    Acc accumulator[outputs_per_thread];
#pragma unroll
    for (int i = 0; i < outputs_per_thread; ++i) accumulator[i] = 0;

    i64 key_first, key_stop;
    band_key_range<C::limit_left, C::limit_right>(options.band, row_start, row_start + rows,
                                                  n_k, &key_first, &key_stop);
    const i64 tile_begin = key_first / block_k;
    const i64 tile_end = key_stop > key_first ? (key_stop + block_k - 1) / block_k : tile_begin;

    for (i64 key_tile = tile_begin; key_tile < tile_end; ++key_tile) {
        const i64 col_start = key_tile * block_k;
        const int cols = static_cast<int>(min(static_cast<i64>(block_k), n_k - col_start));
        __syncthreads();  // the previous tile's readers are done with k_tile/v_tile/scores
        load_rows<C, C::block_k, C::head_dim_pad>(k_tile, k_head, k_strides.col, col_start,
                                                  cols, head_dim);
        // A non-finite K needs nothing here: its masked scores are selected to -inf.
        const bool v_non_finite = __syncthreads_or(load_rows<C, C::block_k, C::value_dim_pad>(
            v_tile, v_head, v_strides.col, col_start, cols, value_dim));

        {
            const int c = threadIdx.x % C::block_k, r0 = threadIdx.x / C::block_k;
            Acc dots[ScoreSlots<C>::count];
            dot_slots<C, C::head_dim_pad, C::head_pitch>(q_tile, k_tile + c * C::head_pitch,
                                                         r0, dots);
#pragma unroll
            for (int i = 0; i < ScoreSlots<C>::count; ++i) {
                const int r = r0 + i * ScoreSlots<C>::row_step;
                Acc score = negative_infinity<Acc>(), unused_grad;
                if (r < rows && c < cols)
                    score = transform_score<C>(dots[i], row_start + r, col_start + c, slope,
                                               options, &unused_grad);
                scores[r * C::score_pitch + c] = score;
            }
        }
        __syncthreads();

        // One warp per row: new running max, probabilities (dropout applied to the copy
        // that multiplies V, not to the row sum), rescale factor for the accumulator.
        for (int r = warp; r < C::block_q; r += C::warps) {
            Acc* score_row = scores + r * C::score_pitch;
            Acc tile_max = negative_infinity<Acc>();
            for (int c = lane; c < C::block_k; c += 32) tile_max = fmax(tile_max, score_row[c]);
            tile_max = warp_max(tile_max);
            const Acc old_max = row_max[r];
            const Acc new_max = fmax(old_max, tile_max);
            // A row with nothing kept yet has max -inf: subtract 0 instead (no inf - inf).
            const Acc safe_max = new_max == negative_infinity<Acc>() ? Acc(0) : new_max;
            const u32 row_state =
                C::dropout ? dropout_row_state(options.dropout_key, static_cast<u32>(bh),
                                               static_cast<u32>(row_start + r) +
                                                   options.dropout_row0)
                           : 0u;
            Acc tile_sum = 0;
            for (int c = lane; c < C::block_k; c += 32) {
                const Acc p = exp_acc(score_row[c] - safe_max);
                tile_sum += p;
                Acc p_used = p;
                if (C::dropout)
                    p_used = dropout_keeps(row_state,
                                           static_cast<u32>(col_start + c) + options.dropout_col0,
                                           options.dropout_threshold)
                                 ? p * options.dropout_scale
                                 : Acc(0);
                score_row[c] = p_used;
            }
            tile_sum = warp_sum(tile_sum);
            // Every lane has read row_max[r] before lane 0 overwrites it: a shuffle orders
            // no memory, __syncwarp does (racecheck flags the write without it).
            __syncwarp();
            if (lane == 0) {
                const Acc rescale = exp_acc(old_max - safe_max);
                row_sum[r] = row_sum[r] * rescale + tile_sum;
                row_max[r] = new_max;
                row_rescale[r] = rescale;
            }
        }
        __syncthreads();

#pragma unroll
        for (int i = 0; i < outputs_per_thread; ++i) {
            const int r = (threadIdx.x + i * C::threads) / C::value_dim_pad;
            accumulator[i] *= row_rescale[r];
        }
        if (v_non_finite)
            accumulate_kept_product<C, C::block_q, C::value_dim_pad, C::block_k, false>(
                accumulator, scores, C::score_pitch, 1, v_tile, C::value_pitch, options.band,
                row_start, col_start);
        else
            accumulate_product<C, C::block_q, C::value_dim_pad, C::block_k>(
                accumulator, scores, C::score_pitch, 1, v_tile, C::value_pitch);
    }
    __syncthreads();  // row_sum/row_max final (also when no key tile ran)

    // Deferred normalisation (FlashAttention-2 section 3.1.1). row_sum == 0 means no key
    // was kept: o = 0 and lse = -inf. A NaN row_sum is not 0, so NaN reaches o and lse.
    const i64 out_row0 = owned.out_head * n_q_total + owned.row_base + row_start;  // in lse
    // o at its own strides (the launcher always passes them; STRIDED_OUT is the tensor-core
    // kernels' switch).
    typename C::T* o_row0 = o + owned.batch * o_strides.batch + owned.head * o_strides.head +
                            (owned.row_base + row_start) * o_strides.row;
#pragma unroll
    for (int i = 0; i < outputs_per_thread; ++i) {
        const int element = threadIdx.x + i * C::threads;
        const int r = element / C::value_dim_pad, c = element % C::value_dim_pad;
        if (r < rows && c < value_dim) {
            const Acc total = row_sum[r];
            const Acc value = total == Acc(0) ? Acc(0) : accumulator[i] / total;
            o_row0[r * o_strides.row + c] = narrow<typename C::T>(value);
        }
    }
    for (int r = threadIdx.x; r < rows; r += C::threads) {
        const Acc total = row_sum[r];
        lse[out_row0 + r] =
            total == Acc(0) ? negative_infinity<Acc>() : row_max[r] + log_acc(total);
    }
}

// ================================================================== backward
// FlashAttention-2 Algorithm 2 with P recomputed from lse and D = rowsum(dO * o) from
// attention_backward_delta.cu. dQ: one block per (batch, head, query tile) looping over
// the key tiles the band reaches. dK/dV: one block per (batch, kv head, key tile),
// looping over every query head of its GQA group and every query tile that the band
// reaches, so dK/dV sum over the group without atomics. Both are deterministic.

// For one (query row, key) pair, from its q.k and dO.v: the probability, its dropout
// factor (keep / (1 - p) or 0) and dS = d(loss)/d(raw score) without the final `scale`.
template <class C>
__device__ __forceinline__ void probability_and_grad(
    typename C::Acc dot, typename C::Acc dp, typename C::Acc lse_row,
    typename C::Acc delta_row, i64 row, i64 col, i64 bh, typename C::Acc slope,
    const ScoreOptions<typename C::Acc>& options, typename C::Acc* probability,
    typename C::Acc* keep, typename C::Acc* dscore) {
    typedef typename C::Acc Acc;
    Acc softcap_grad = 1;
    const Acc score = transform_score<C>(dot, row, col, slope, options, &softcap_grad);
    // lse = -inf marks a row that kept nothing: its probabilities are all 0.
    const Acc safe_lse = lse_row == negative_infinity<Acc>() ? -lse_row : lse_row;
    const Acc p = exp_acc(score - safe_lse);
    Acc keep_scale = 1;
    if (C::dropout) {
        const u32 row_state =
            dropout_row_state(options.dropout_key, static_cast<u32>(bh),
                              static_cast<u32>(row) + options.dropout_row0);
        keep_scale = dropout_keeps(row_state, static_cast<u32>(col) + options.dropout_col0,
                                   options.dropout_threshold)
                         ? options.dropout_scale
                         : Acc(0);
    }
    *probability = p;
    *keep = keep_scale;
    Acc ds = p * (dp * keep_scale - delta_row);
    if (C::softcap) ds *= softcap_grad;
    *dscore = ds;
}

// dS (and, unless `dropped` is null, the dropped P) for the whole score tile; entries
// outside the valid rows/columns are 0.
template <class C>
__device__ __forceinline__ void score_grad_slots(
    const typename C::Acc* q_tile, const typename C::Acc* k_tile,
    const typename C::Acc* v_tile, const typename C::Acc* do_tile,
    const typename C::Acc* lse_tile, const typename C::Acc* delta_tile, int rows, int cols,
    i64 row_start, i64 col_start, i64 bh, typename C::Acc slope,
    const ScoreOptions<typename C::Acc>& options, typename C::Acc* dropped,
    typename C::Acc* dscores) {
    typedef typename C::Acc Acc;
    const int c = threadIdx.x % C::block_k, r0 = threadIdx.x / C::block_k;
    Acc dots[ScoreSlots<C>::count], dps[ScoreSlots<C>::count];
    dot_slots<C, C::head_dim_pad, C::head_pitch>(q_tile, k_tile + c * C::head_pitch, r0, dots);
    dot_slots<C, C::value_dim_pad, C::value_pitch>(do_tile, v_tile + c * C::value_pitch, r0,
                                                   dps);
#pragma unroll
    for (int i = 0; i < ScoreSlots<C>::count; ++i) {
        const int r = r0 + i * ScoreSlots<C>::row_step;
        // Masked pairs get p = dS = 0 by this select, not from exp(-inf - lse) times dP:
        // dP may be NaN there (a non-finite v or dO) and lse may be NaN.
        Acc p = 0, keep = 0, ds = 0;
        if (r < rows && c < cols &&
            band_keeps<C::limit_left, C::limit_right>(options.band, row_start + r,
                                                      col_start + c))
            probability_and_grad<C>(dots[i], dps[i], lse_tile[r], delta_tile[r], row_start + r,
                                    col_start + c, bh, slope, options, &p, &keep, &ds);
        if (dropped != nullptr) dropped[r * C::score_pitch + c] = p * keep;
        dscores[r * C::score_pitch + c] = ds;
    }
}

// lse and D of rows [row_start, row_start + rows) of one head: `lse_head` and `delta_head`
// point at the head's (or sequence's) row 0.
template <class C>
__device__ __forceinline__ void load_row_stats(typename C::Acc* lse_tile,
                                               typename C::Acc* delta_tile,
                                               const typename C::Acc* lse_head,
                                               i64 lse_row_stride,
                                               const typename C::Acc* delta_head,
                                               i64 row_start, int rows) {
    for (int r = threadIdx.x; r < C::block_q; r += C::threads) {
        typename C::Acc lse_value = 0, delta_value = 0;
        if (r < rows) {
            lse_value = lse_head[(row_start + r) * lse_row_stride];
            delta_value = delta_head[row_start + r];
        }
        lse_tile[r] = lse_value;
        delta_tile[r] = delta_value;
    }
}

template <class C>
__device__ void backward_dkdv_tile(
    const typename C::T* q, const typename C::T* k, const typename C::T* v,
    const typename C::T* d_out, const typename C::Acc* lse, const typename C::Acc* delta,
    typename C::T* dk, typename C::T* dv, const double* alibi_slopes, i64 n_q_total,
    i64 n_k_total, int n_q_heads, int group_size, int head_dim, int value_dim, int block_q,
    int block_k, HeadStrides q_strides, HeadStrides k_strides, HeadStrides v_strides,
    HeadStrides do_strides, i64 lse_batch_stride, i64 lse_head_stride, i64 lse_row_stride,
    OutputStrides dk_strides, OutputStrides dv_strides, ScoreOptions<typename C::Acc> options,
    const KeyBlock& owned, i64 col_start) {
    typedef typename C::Acc Acc;
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    Acc* k_tile = reinterpret_cast<Acc*>(shared_bytes);       // [block_k][head_pitch]
    Acc* v_tile = k_tile + C::block_k * C::head_pitch;        // [block_k][value_pitch]
    Acc* q_tile = v_tile + C::block_k * C::value_pitch;       // [block_q][head_pitch]
    Acc* do_tile = q_tile + C::block_q * C::head_pitch;       // [block_q][value_pitch]
    Acc* dropped = do_tile + C::block_q * C::value_pitch;     // [block_q][score_pitch]
    Acc* dscores = dropped + C::block_q * C::score_pitch;     // [block_q][score_pitch]
    Acc* lse_tile = dscores + C::block_q * C::score_pitch;    // [block_q]
    Acc* delta_tile = lse_tile + C::block_q;                  // [block_q]
    require_shared_bytes(sizeof(Acc) * (delta_tile + C::block_q - k_tile));

    const i64 batch = owned.batch, n_q = owned.n_q, n_k = owned.n_k;
    const int kv_head = owned.kv_head;
    options.band.offset = owned.band_offset;
    const int cols = static_cast<int>(min(static_cast<i64>(block_k), n_k - col_start));
    __syncthreads();  // a previous tile's readers of the K and V tiles are done

    load_tile<C, C::block_k, C::head_dim_pad>(
        k_tile,
        k + batch * k_strides.batch + kv_head * k_strides.head + owned.key_base * k_strides.row,
        k_strides, col_start, cols, head_dim);
    load_tile<C, C::block_k, C::value_dim_pad>(
        v_tile,
        v + batch * v_strides.batch + kv_head * v_strides.head + owned.key_base * v_strides.row,
        v_strides, col_start, cols, value_dim);

    constexpr int dk_per_thread = C::block_k * C::head_dim_pad / C::threads;
    constexpr int dv_per_thread = C::block_k * C::value_dim_pad / C::threads;
    Acc dk_acc[dk_per_thread], dv_acc[dv_per_thread];
#pragma unroll
    for (int i = 0; i < dk_per_thread; ++i) dk_acc[i] = 0;
#pragma unroll
    for (int i = 0; i < dv_per_thread; ++i) dv_acc[i] = 0;

    i64 row_first, row_stop;
    band_row_range<C::limit_left, C::limit_right>(options.band, col_start, col_start + cols,
                                                  n_q, &row_first, &row_stop);
    const i64 tile_begin = row_first / block_q;
    const i64 tile_end = row_stop > row_first ? (row_stop + block_q - 1) / block_q : tile_begin;

    for (int member = 0; member < group_size; ++member) {
        const int head = kv_head * group_size + member;
        const i64 bh = owned.index * n_q_heads + head;  // dropout and ALiBi
        const i64 array_head = batch * n_q_heads + head;
        const Acc slope = alibi_slope_of<C>(alibi_slopes, bh);
        for (i64 query_tile = tile_begin; query_tile < tile_end; ++query_tile) {
            const i64 row_start = query_tile * block_q;
            const int rows = static_cast<int>(min(static_cast<i64>(block_q), n_q - row_start));
            __syncthreads();  // the previous query tile's readers are done
            const bool q_loaded_non_finite = load_tile<C, C::block_q, C::head_dim_pad>(
                q_tile,
                q + batch * q_strides.batch + head * q_strides.head +
                    owned.row_base * q_strides.row,
                q_strides, row_start, rows, head_dim);
            const bool do_loaded_non_finite = load_tile<C, C::block_q, C::value_dim_pad>(
                do_tile,
                d_out + batch * do_strides.batch + head * do_strides.head +
                    owned.row_base * do_strides.row,
                do_strides, row_start, rows, value_dim);
            load_row_stats<C>(lse_tile, delta_tile,
                              lse + batch * lse_batch_stride + head * lse_head_stride +
                                  owned.row_base * lse_row_stride,
                              lse_row_stride, delta + array_head * n_q_total + owned.row_base,
                              row_start, rows);
            const bool q_non_finite = __syncthreads_or(q_loaded_non_finite);
            const bool do_non_finite = __syncthreads_or(do_loaded_non_finite);

            score_grad_slots<C>(q_tile, k_tile, v_tile, do_tile, lse_tile, delta_tile, rows,
                                cols, row_start, col_start, bh, slope, options, dropped,
                                dscores);
            __syncthreads();

            // dK += dS^T Q and dV += P_dropped^T dO over this query tile's rows (the score
            // tiles read transposed: key c is the row, query r the inner index).
            // A non-finite Q row or dO row reaches only the keys it keeps.
            if (q_non_finite)
                accumulate_kept_product<C, C::block_k, C::head_dim_pad, C::block_q, true>(
                    dk_acc, dscores, 1, C::score_pitch, q_tile, C::head_pitch, options.band,
                    row_start, col_start);
            else
                accumulate_product<C, C::block_k, C::head_dim_pad, C::block_q>(
                    dk_acc, dscores, 1, C::score_pitch, q_tile, C::head_pitch);
            if (do_non_finite)
                accumulate_kept_product<C, C::block_k, C::value_dim_pad, C::block_q, true>(
                    dv_acc, dropped, 1, C::score_pitch, do_tile, C::value_pitch, options.band,
                    row_start, col_start);
            else
                accumulate_product<C, C::block_k, C::value_dim_pad, C::block_q>(
                    dv_acc, dropped, 1, C::score_pitch, do_tile, C::value_pitch);
        }
    }

    // dk and dv at their own strides (the launcher always passes them, as o's).
    const i64 out_row0 = owned.key_base + col_start;
    typename C::T* dk_row0 = dk + batch * dk_strides.batch + kv_head * dk_strides.head +
                             out_row0 * dk_strides.row;
    typename C::T* dv_row0 = dv + batch * dv_strides.batch + kv_head * dv_strides.head +
                             out_row0 * dv_strides.row;
#pragma unroll
    for (int i = 0; i < dk_per_thread; ++i) {
        const int element = threadIdx.x + i * C::threads;
        const int c = element / C::head_dim_pad, d = element % C::head_dim_pad;
        if (c < cols && d < head_dim)
            dk_row0[c * dk_strides.row + d] = narrow<typename C::T>(options.scale * dk_acc[i]);
    }
#pragma unroll
    for (int i = 0; i < dv_per_thread; ++i) {
        const int element = threadIdx.x + i * C::threads;
        const int c = element / C::value_dim_pad, d = element % C::value_dim_pad;
        if (c < cols && d < value_dim)
            dv_row0[c * dv_strides.row + d] = narrow<typename C::T>(dv_acc[i]);
    }
}

template <class C>
__device__ void backward_dq_tile(
    const typename C::T* q, const typename C::T* k, const typename C::T* v,
    const typename C::T* d_out, const typename C::Acc* lse, const typename C::Acc* delta,
    typename C::T* dq, const double* alibi_slopes, i64 n_q_total, i64 n_k_total,
    int n_q_heads, int group_size, int head_dim, int value_dim, int block_q, int block_k,
    HeadStrides q_strides, HeadStrides k_strides, HeadStrides v_strides,
    HeadStrides do_strides, i64 lse_batch_stride, i64 lse_head_stride, i64 lse_row_stride,
    OutputStrides dq_strides, ScoreOptions<typename C::Acc> options,
    const SequenceTables& tables) {
    typedef typename C::Acc Acc;
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    Acc* k_tile = reinterpret_cast<Acc*>(shared_bytes);       // [block_k][head_pitch]
    Acc* v_tile = k_tile + C::block_k * C::head_pitch;        // [block_k][value_pitch]
    Acc* q_tile = v_tile + C::block_k * C::value_pitch;       // [block_q][head_pitch]
    Acc* do_tile = q_tile + C::block_q * C::head_pitch;       // [block_q][value_pitch]
    Acc* dscores = do_tile + C::block_q * C::value_pitch;     // [block_q][score_pitch]
    Acc* lse_tile = dscores + C::block_q * C::score_pitch;    // [block_q]
    Acc* delta_tile = lse_tile + C::block_q;                  // [block_q]
    require_shared_bytes(sizeof(Acc) * (delta_tile + C::block_q - k_tile));

    const QueryBlock owned = query_block(block_q, n_q_total, n_k_total, options.band.offset,
                                         n_q_heads, group_size, tables);
    const i64 bh = owned.bh, batch = owned.batch, n_q = owned.n_q, n_k = owned.n_k;
    const int head = owned.head, kv_head = owned.kv_head;
    options.band.offset = owned.band_offset;
    const typename C::T* k_head = k + batch * k_strides.batch + kv_head * k_strides.head +
                                  owned.key_base * k_strides.row;
    const typename C::T* v_head = v + batch * v_strides.batch + kv_head * v_strides.head +
                                  owned.key_base * v_strides.row;
    const i64 row_start = owned.row_start;
    const int rows = static_cast<int>(min(static_cast<i64>(block_q), n_q - row_start));
    const Acc slope = alibi_slope_of<C>(alibi_slopes, bh);

    load_tile<C, C::block_q, C::head_dim_pad>(
        q_tile,
        q + batch * q_strides.batch + head * q_strides.head + owned.row_base * q_strides.row,
        q_strides, row_start, rows, head_dim);
    load_tile<C, C::block_q, C::value_dim_pad>(
        do_tile,
        d_out + batch * do_strides.batch + head * do_strides.head +
            owned.row_base * do_strides.row,
        do_strides, row_start, rows, value_dim);
    load_row_stats<C>(lse_tile, delta_tile,
                      lse + batch * lse_batch_stride + head * lse_head_stride +
                          owned.row_base * lse_row_stride,
                      lse_row_stride, delta + owned.out_head * n_q_total + owned.row_base,
                      row_start, rows);

    constexpr int dq_per_thread = C::block_q * C::head_dim_pad / C::threads;
    Acc dq_acc[dq_per_thread];
#pragma unroll
    for (int i = 0; i < dq_per_thread; ++i) dq_acc[i] = 0;

    i64 key_first, key_stop;
    band_key_range<C::limit_left, C::limit_right>(options.band, row_start, row_start + rows,
                                                  n_k, &key_first, &key_stop);
    const i64 tile_begin = key_first / block_k;
    const i64 tile_end = key_stop > key_first ? (key_stop + block_k - 1) / block_k : tile_begin;

    // dQ += dS K over the key tiles (D = rowsum(dO * o) from attention_backward_delta.cu).
    for (i64 key_tile = tile_begin; key_tile < tile_end; ++key_tile) {
        const i64 col_start = key_tile * block_k;
        const int cols = static_cast<int>(min(static_cast<i64>(block_k), n_k - col_start));
        __syncthreads();
        const bool k_loaded_non_finite = load_tile<C, C::block_k, C::head_dim_pad>(
            k_tile, k_head, k_strides, col_start, cols, head_dim);
        load_tile<C, C::block_k, C::value_dim_pad>(v_tile, v_head, v_strides, col_start, cols,
                                                   value_dim);
        const bool k_non_finite = __syncthreads_or(k_loaded_non_finite);

        score_grad_slots<C>(q_tile, k_tile, v_tile, do_tile, lse_tile, delta_tile, rows,
                                   cols, row_start, col_start, bh, slope, options, nullptr,
                                   dscores);
        __syncthreads();

        // dQ += dS K over this key tile (a non-finite key reaches only the rows keeping it).
        if (k_non_finite)
            accumulate_kept_product<C, C::block_q, C::head_dim_pad, C::block_k, false>(
                dq_acc, dscores, C::score_pitch, 1, k_tile, C::head_pitch, options.band,
                row_start, col_start);
        else
            accumulate_product<C, C::block_q, C::head_dim_pad, C::block_k>(
                dq_acc, dscores, C::score_pitch, 1, k_tile, C::head_pitch);
    }

    // dq at its own strides (the launcher always passes them, as o's).
    typename C::T* dq_row0 = dq + batch * dq_strides.batch + head * dq_strides.head +
                             (owned.row_base + row_start) * dq_strides.row;
#pragma unroll
    for (int i = 0; i < dq_per_thread; ++i) {
        const int element = threadIdx.x + i * C::threads;
        const int r = element / C::head_dim_pad, d = element % C::head_dim_pad;
        if (r < rows && d < head_dim)
            dq_row0[r * dq_strides.row + d] = narrow<typename C::T>(options.scale * dq_acc[i]);
    }
}

// ================================================================== entry points

#define SCORE_OPTION_PARAMS                                                                  \
    ACCUM scale, ACCUM softcap, i64 band_offset, i64 window_left, i64 window_right,          \
        u32 dropout_key, u32 dropout_threshold, ACCUM dropout_scale, u32 dropout_row0,       \
        u32 dropout_col0
#define SCORE_OPTIONS                                                                        \
    ScoreOptions<ACCUM>{scale,       softcap,          Band{band_offset, window_left, window_right}, \
                        dropout_key, dropout_threshold, dropout_scale, dropout_row0, dropout_col0}

extern "C" __global__ void __launch_bounds__(THREADS)
    attention_forward(const STORAGE* q, const STORAGE* k, const STORAGE* v, STORAGE* o,
                      ACCUM* lse, const double* alibi_slopes, i64 n_q, i64 n_k, int n_q_heads,
                      int group_size, int head_dim, int value_dim, int block_q, int block_k,
                      i64 q_sb, i64 q_sh, i64 q_sn, i64 q_sd, i64 k_sb, i64 k_sh, i64 k_sn,
                      i64 k_sd, i64 v_sb, i64 v_sh, i64 v_sn, i64 v_sd, i64 o_sb, i64 o_sh,
                      i64 o_sn, SCORE_OPTION_PARAMS, SEQUENCE_PARAMETERS) {
    forward_tile<Config>(q, k, v, o, lse, alibi_slopes, n_q, n_k, n_q_heads, group_size,
                         head_dim, value_dim, block_q, block_k, HeadStrides{q_sb, q_sh, q_sn, q_sd},
                         HeadStrides{k_sb, k_sh, k_sn, k_sd}, HeadStrides{v_sb, v_sh, v_sn, v_sd},
                         OutputStrides{o_sb, o_sh, o_sn}, SCORE_OPTIONS, SEQUENCE_TABLES);
}

#define BACKWARD_DKDV_ARRAYS                                                                 \
    const STORAGE *q, const STORAGE *k, const STORAGE *v, const STORAGE *d_out,              \
        const ACCUM *lse, const ACCUM *delta, STORAGE *dk, STORAGE *dv
#define BACKWARD_DKDV_SCALARS                                                                \
    const double *alibi_slopes, i64 n_q, i64 n_k, int n_q_heads, int group_size,             \
        int head_dim, int value_dim, int block_q, int block_k, i64 q_sb, i64 q_sh, i64 q_sn, \
        i64 q_sd, i64 k_sb, i64 k_sh, i64 k_sn, i64 k_sd, i64 v_sb, i64 v_sh, i64 v_sn,      \
        i64 v_sd, i64 do_sb, i64 do_sh, i64 do_sn, i64 do_sd, i64 lse_sb, i64 lse_sh,        \
        i64 lse_sn, SCORE_OPTION_PARAMS, SEQUENCE_PARAMETERS, i64 dk_sb, i64 dk_sh,          \
        i64 dk_sn, i64 dv_sb, i64 dv_sh, i64 dv_sn
#define BACKWARD_DKDV_TILE(owned, col_start)                                                 \
    backward_dkdv_tile<Config>(q, k, v, d_out, lse, delta, dk, dv, alibi_slopes, n_q, n_k,   \
                               n_q_heads, group_size, head_dim, value_dim, block_q, block_k, \
                               HeadStrides{q_sb, q_sh, q_sn, q_sd},                          \
                               HeadStrides{k_sb, k_sh, k_sn, k_sd},                          \
                               HeadStrides{v_sb, v_sh, v_sn, v_sd},                          \
                               HeadStrides{do_sb, do_sh, do_sn, do_sd}, lse_sb, lse_sh,      \
                               lse_sn, OutputStrides{dk_sb, dk_sh, dk_sn},                   \
                               OutputStrides{dv_sb, dv_sh, dv_sn}, SCORE_OPTIONS, owned,     \
                               col_start)

extern "C" __global__ void __launch_bounds__(THREADS)
    attention_backward_dkdv(BACKWARD_DKDV_ARRAYS, BACKWARD_DKDV_SCALARS) {
    const KeyBlock owned = key_block(block_k, n_q, n_k, band_offset, n_q_heads / group_size,
                                     SEQUENCE_TABLES);
    BACKWARD_DKDV_TILE(owned, owned.key_start);
}

// dK and dV again for the key blocks of a 16-bit tensor-core dK/dV kernel that flagged
// inf or NaN in their owned K or V rows (`key_flags[block]`, FLAG_NON_FINITE_KEYS there):
// `key_blocks` blocks of `owned_rows` keys, in that kernel's block order (`tile_major`).
// Those kernels stream query tiles whose rows past n_q are zero rows of Q, dO, lse and D;
// against an infinite key element they score 0 x inf = NaN, which would reach dk and dv of
// a key that no real query keeps. Here only real rows are read. The grid is a few blocks an
// SM; block b owns the flags b, b + gridDim.x, ... and its threads read as many of them
// at once, so with finite keys a block reads a flag a thread and returns (a block per key
// block would be tens of thousands of blocks for few query rows over long keys).
// Every branch below is the same for the whole block (a flag is read by all its threads),
// so the barriers inside a tile stay uniform.
extern "C" __global__ void __launch_bounds__(THREADS)
    attention_backward_dkdv_redo(BACKWARD_DKDV_ARRAYS, const int* key_flags,
                                 BACKWARD_DKDV_SCALARS, int owned_rows, int tile_major,
                                 int key_blocks) {
    const int n_kv_heads = n_q_heads / group_size;
    const i64 stride = gridDim.x, pass = stride * blockDim.x;
    for (i64 first = blockIdx.x; first < key_blocks; first += pass) {
        const i64 mine = first + threadIdx.x * stride;
        if (!__syncthreads_or(mine < key_blocks && key_flags[mine])) continue;
        const i64 last = min(first + pass, static_cast<i64>(key_blocks));
        for (i64 block = first; block < last; block += stride) {
            if (!key_flags[block]) continue;
            const KeyBlock owned =
                tile_major ? key_block<true>(owned_rows, n_q, n_k, band_offset, n_kv_heads,
                                             SEQUENCE_TABLES, block)
                           : key_block<false>(owned_rows, n_q, n_k, band_offset, n_kv_heads,
                                              SEQUENCE_TABLES, block);
            const i64 stop = min(owned.key_start + owned_rows, owned.n_k);
            for (i64 col_start = owned.key_start; col_start < stop; col_start += block_k)
                BACKWARD_DKDV_TILE(owned, col_start);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) attention_backward_dq(
    const STORAGE* q, const STORAGE* k, const STORAGE* v, const STORAGE* d_out,
    const ACCUM* lse, const ACCUM* delta, STORAGE* dq, const double* alibi_slopes, i64 n_q,
    i64 n_k, int n_q_heads, int group_size, int head_dim, int value_dim, int block_q,
    int block_k, i64 q_sb, i64 q_sh, i64 q_sn, i64 q_sd, i64 k_sb, i64 k_sh, i64 k_sn,
    i64 k_sd, i64 v_sb, i64 v_sh, i64 v_sn, i64 v_sd, i64 do_sb, i64 do_sh, i64 do_sn,
    i64 do_sd, i64 lse_sb, i64 lse_sh, i64 lse_sn, SCORE_OPTION_PARAMS, SEQUENCE_PARAMETERS,
    i64 dq_sb, i64 dq_sh, i64 dq_sn) {
    backward_dq_tile<Config>(q, k, v, d_out, lse, delta, dq, alibi_slopes, n_q, n_k, n_q_heads,
                             group_size, head_dim, value_dim, block_q, block_k,
                             HeadStrides{q_sb, q_sh, q_sn, q_sd},
                             HeadStrides{k_sb, k_sh, k_sn, k_sd},
                             HeadStrides{v_sb, v_sh, v_sn, v_sd},
                             HeadStrides{do_sb, do_sh, do_sn, do_sd}, lse_sb, lse_sh, lse_sn,
                             OutputStrides{dq_sb, dq_sh, dq_sn}, SCORE_OPTIONS, SEQUENCE_TABLES);
}
