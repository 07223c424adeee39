// PTX wrappers shared by the tensor-core kernels (attention_mma_forward.cu,
// attention_mma_backward.cu, attention_tf32_forward.cu): cp.async copies, ldmatrix, mma.sync.m16n8k16 and the
// packing of float pairs into its 16-bit operands. IS_BFLOAT16 (a -D option) picks the type.
#pragma once
#include "sequences.cuh"

typedef unsigned short bits16;

// A head dim rounded up to the tensor cores' K step (16 for 16-bit inputs, 8 for TF32): the
// width of its shared tiles and accumulators. The padding columns hold zeros.
__host__ __device__ constexpr int padded_width(int dim, int step) {
    return (dim + step - 1) / step * step;
}

// ------------------------------------------------------------------ PTX wrappers

__device__ __forceinline__ u32 shared_address(const void* pointer) {
    u32 address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
        : "=r"(address)
        : "l"(pointer));
    return address;
}

// A kernel built with L2_PREFETCH (64, 128 or 256) asks L2 to fetch that many bytes around
// each 16-byte asynchronous copy (cp.async's prefetch-size qualifier): kernels that stream
// long contiguous rows (the decode) read DRAM in larger requests.
#if defined(L2_PREFETCH) && L2_PREFETCH == 256
#define CP_ASYNC_CG_16 "cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n"
#elif defined(L2_PREFETCH) && L2_PREFETCH == 128
#define CP_ASYNC_CG_16 "cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n"
#elif defined(L2_PREFETCH) && L2_PREFETCH == 64
#define CP_ASYNC_CG_16 "cp.async.cg.shared.global.L2::64B [%0], [%1], 16, %2;\n"
#else
#define CP_ASYNC_CG_16 "cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
#endif

// 16 bytes global -> shared, asynchronously; `valid == false` writes 16 zero bytes instead
// (rows past the end of the sequence must be 0, not stale data: 0 * NaN would be NaN).
__device__ __forceinline__ void copy_16_async(u32 destination, const void* source, bool valid) {
    const int source_bytes = valid ? 16 : 0;
    asm volatile(CP_ASYNC_CG_16 ::"r"(destination), "l"(source), "r"(source_bytes));
}
// 4 bytes global -> shared (a float of per-row statistics); zeros when `valid == false`.
__device__ __forceinline__ void copy_4_async(u32 destination, const void* source, bool valid) {
    const int source_bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(destination),
                 "l"(source), "r"(source_bytes));
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }
template <int Pending> __device__ __forceinline__ void wait_copies() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

__device__ __forceinline__ void load_matrix_x4(u32 address, u32* fragment) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(fragment[0]), "=r"(fragment[1]), "=r"(fragment[2]), "=r"(fragment[3])
                 : "r"(address));
}
__device__ __forceinline__ void load_matrix_x4_transposed(u32 address, u32* fragment) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(fragment[0]), "=r"(fragment[1]), "=r"(fragment[2]), "=r"(fragment[3])
                 : "r"(address));
}

// c += a * b for one m16n8k16 tile, fp32 accumulators.
__device__ __forceinline__ void mma_16x8x16(float* c, const u32* a, u32 b0, u32 b1) {
#if IS_BFLOAT16
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two floats rounded to the input type, `low` in the low half (the lower column index).
__device__ __forceinline__ u32 pack_pair(float low, float high) {
    u32 packed;
#if IS_BFLOAT16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(high), "f"(low));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(high), "f"(low));
#endif
    return packed;
}

// Two adjacent outputs of a row: a 16-bit pair as one 32-bit store, a float pair as one
// 64-bit store (the address is 8-byte aligned: an even column of an even-width row).
__device__ __forceinline__ void store_pair(bits16* out, float low, float high) {
    *reinterpret_cast<u32*>(out) = pack_pair(low, high);
}
__device__ __forceinline__ void store_pair(float* out, float low, float high) {
    asm volatile("st.v2.f32 [%0], {%1, %2};\n" ::"l"(out), "f"(low), "f"(high) : "memory");
}
__device__ __forceinline__ void store_pair(double* out, double low, double high) {
    asm volatile("st.v2.f64 [%0], {%1, %2};\n" ::"l"(out), "d"(low), "d"(high) : "memory");
}

// Columns [col, col + 2) of an output row of ValueDim columns (rows of a padded tile have
// columns past ValueDim, which are dropped): one 32- or 64-bit store where the pair lies
// inside the row and the row width keeps it aligned, else element by element.
template <int ValueDim>
__device__ __forceinline__ void store_row_pair(bits16* row, int col, float low, float high) {
    if constexpr (ValueDim % 2 == 0) {
        if (col < ValueDim) store_pair(row + col, low, high);
    } else {
        const u32 packed = pack_pair(low, high);
        if (col < ValueDim) row[col] = static_cast<bits16>(packed & 0xffffu);
        if (col + 1 < ValueDim) row[col + 1] = static_cast<bits16>(packed >> 16);
    }
}
template <int ValueDim, typename Real>
__device__ __forceinline__ void store_row_pair(Real* row, int col, Real low, Real high) {
    if constexpr (ValueDim % 2 == 0) {
        if (col < ValueDim) store_pair(row + col, low, high);
    } else {
        if (col < ValueDim) row[col] = low;
        if (col + 1 < ValueDim) row[col + 1] = high;
    }
}

constexpr float kLog2e = 1.4426950408889634f;

// The units of the logits that the softmax of the tensor-core kernels runs on
// (forward_softmax.cuh, backward_scores.cuh). 16-bit inputs: base 2, scale * log2(e) folded
// into the one multiply per score, lse stored as (max + log2 sum) * ln 2 and multiplied back
// by log2(e) in the backward; their tolerances absorb those roundings. float32 (IS_FLOAT32:
// the 3xTF32 forward and the float32 backward): natural units, as the golden model and the
// CPU backend, with P = exp2((logit - max or lse) * log2(e)), the subtraction first. At
// |logit| ~ 1e4 the base-2 round trip of lse left the dominant key's P ~1e-3 off, 1.35x the
// float32 tolerance in dV (tests/test_backend_suite.py's large-score test, NOTES-gpu.md).
#if (defined(IS_FLOAT32) && IS_FLOAT32) || (defined(IS_FLOAT64) && IS_FLOAT64)
constexpr bool kNaturalLogits = true;
#else
constexpr bool kNaturalLogits = false;
#endif
// The factor from scaled scores to logits in those units.
constexpr float kLogitUnit = kNaturalLogits ? 1.0f : kLog2e;

// The score options' factors in logit units, in the accumulators' type Real, for the
// forward's score records and the backward's alike (forward_softmax.cuh, backward_scores.cuh):
// scale, scale / softcap, softcap and this head's ALiBi slope.
template <typename Real, class Record>
__device__ __forceinline__ void set_logit_factors(Record& scores, Real scale, Real softcap,
                                                  const double* slopes, i64 bh) {
    scores.logit_scale = scale * static_cast<Real>(kLogitUnit);
    scores.scale_over_softcap = SOFTCAP ? scale / softcap : Real(0);
    scores.logit_softcap = softcap * static_cast<Real>(kLogitUnit);
    scores.logit_slope =
        ALIBI ? static_cast<Real>(slopes[bh]) * static_cast<Real>(kLogitUnit) : Real(0);
}

// 2^x; -inf gives +0 and NaN stays NaN, which the masking and the NaN semantics rely on.
__device__ __forceinline__ float exp2_approx(float x) {
    float result;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(result) : "f"(x));
    return result;
}

// e^difference for a difference of two logits: in natural units exp2(difference * log2(e)),
// the difference rounded once before the multiply (__fmul_rn: no fma may fold it into the
// subtraction, which would round differently); in base 2 exp2(difference).
__device__ __forceinline__ float exp_of_logit_difference(float difference) {
    if constexpr (kNaturalLogits) return exp2_approx(__fmul_rn(difference, kLog2e));
    return exp2_approx(difference);
}
// float64 (IS_FLOAT64, natural units): the library's double exponential (within an ulp),
// the precision of the golden model's.
__device__ __forceinline__ double exp_of_logit_difference(double difference) {
    return exp(difference);
}

// ------------------------------------------------------------------ tiles and fragments
// Shared tiles hold rows of Cols 16-bit elements padded to Cols + 8: the 16-byte pad puts
// the 8 rows an ldmatrix phase reads in 8 different bank groups.

template <int Cols> constexpr int kTilePitch = Cols + 8;

// A tile's element (row, col): rows kTilePitch<Cols> apart (padded) or, Swizzled, Cols apart
// (Cols a multiple of 16) with each row's 16-byte chunks permuted. Both put the 8 rows of
// an ldmatrix phase (same column) in 8 different 16-byte bank groups; unpadded rows fill
// whole 128-byte lines, which 16-byte cp.async copies write ~5 % faster than lines that
// padding shifts by 16 bytes a row (bench/NOTES-gpu.md v54, a copy-only kernel at 4 GiB).
// 8 consecutive rows start at kRowBases different offsets within a 128-byte line (1, 2 or
// 4); chunk c of row r goes to c ^ ((r / kRowBases) % kGroup) within its aligned group of
// kGroup = 8 / kRowBases chunks, so the rows that share an offset take different chunks.
template <int Cols>
constexpr int kRowBases = (2 * Cols) % 128 == 0 ? 1 : (2 * Cols) % 64 == 0 ? 2 : 4;
template <int Cols, bool Swizzled>
__device__ __forceinline__ int tile_offset(int row, int col) {
    if constexpr (Swizzled) {
        static_assert(Cols % 16 == 0, "swizzled rows are whole 32-byte groups");
        constexpr int kGroup = 8 / kRowBases<Cols>;
        const int chunk = (col >> 3) ^ ((row / kRowBases<Cols>) & (kGroup - 1));
        return row * Cols + ((chunk << 3) | (col & 7));
    } else {
        return row * kTilePitch<Cols> + col;
    }
}

// The shared-memory bytes [address, address + ChunkBytes) from `source`, asynchronously,
// zeros when `valid == false`. 16-byte copies bypass L1; narrower ones (head dims that are
// not a multiple of 8, rows that are not 16-byte aligned) need the L1 path.
// 2-byte pieces (an odd head dim) have no asynchronous copy: they are loaded and stored
// in place, so such tiles arrive without overlap (correct, and rare).
template <int ChunkBytes>
__device__ __forceinline__ void copy_chunk_async(u32 destination, const void* source,
                                                 bool valid) {
    const int source_bytes = valid ? ChunkBytes : 0;
    if constexpr (ChunkBytes == 2) {
        const unsigned short value = valid ? *static_cast<const unsigned short*>(source) : 0;
        asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(destination), "h"(value) : "memory");
    } else if constexpr (ChunkBytes == 16)
        asm volatile(CP_ASYNC_CG_16 ::"r"(destination), "l"(source), "r"(source_bytes));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(destination),
                     "l"(source), "n"(ChunkBytes), "r"(source_bytes));
}

// 16 bytes of a row into shared memory: columns [col, col + 8) of `row_pointer`, in pieces of
// ChunkBytes; columns at or past Columns (the padding of the head dim) and whole rows past
// the end (`row_valid` false) become zeros, since 0 * NaN would otherwise reach the products.
template <int Columns, int Width, int ChunkBytes, typename T>
__device__ __forceinline__ void copy_row_chunk(u32 destination, const T* row_pointer,
                                               const T* fallback, int col, bool row_valid) {
    constexpr int kElements = ChunkBytes / sizeof(T);
#pragma unroll
    for (int piece = 0; piece < 16 / ChunkBytes; ++piece) {
        const int first = col + piece * kElements;
        const bool valid = row_valid && (Columns == Width || first < Columns);
        copy_chunk_async<ChunkBytes>(destination + piece * ChunkBytes,
                                     valid ? row_pointer + first : fallback, valid);
    }
}

// Rows [row_start, row_start + Rows) of one head (row stride `row_stride`, contiguous
// columns, Columns of them) into tile[Rows][Pitch] (Width <= Pitch columns used: Columns
// and zero padding) by `Threads` threads in 16-byte chunks, each in copies of ChunkBytes;
// rows at or past `row_limit` become zeros.
template <int Rows, int Columns, int Width, int Threads, int Pitch, int ChunkBytes, typename T,
          class Source>
__device__ __forceinline__ void load_rows_async(T* tile, const Source& source, i64 row_start,
                                                i64 row_limit) {
    constexpr int chunk_elements = 16 / sizeof(T);
    constexpr int chunks_per_row = Width / chunk_elements;
    static_assert(Width % chunk_elements == 0 && Width <= Pitch, "whole chunks per row");
    const auto rows = source.for_tile(row_start, Rows);
#pragma unroll
    for (int chunk = threadIdx.x; chunk < Rows * chunks_per_row; chunk += Threads) {
        const int r = chunk / chunks_per_row, c = chunk % chunks_per_row;
        const i64 row = row_start + r;
        const bool valid = row < row_limit;
        copy_row_chunk<Columns, Width, ChunkBytes>(
            shared_address(tile + r * Pitch + c * chunk_elements), rows.at(row, valid),
            rows.fallback(), c * chunk_elements, valid);
    }
}

// The same for rows `row_stride` apart from `head`.
template <int Rows, int Columns, int Width, int Threads, int Pitch, int ChunkBytes, typename T>
__device__ __forceinline__ void load_tile_async(T* tile, const T* head, i64 row_stride,
                                                i64 row_start, i64 row_limit) {
    load_rows_async<Rows, Columns, Width, Threads, Pitch, ChunkBytes>(
        tile, StridedRows<T>{head, row_stride}, row_start, row_limit);
}

// The A fragment (16 x 16, row-major) at rows [row0, row0 + 16), columns [col0, col0 + 16)
// of a tile: lanes 0-15 address the rows at col0, lanes 16-31 the same rows at col0 + 8,
// which is a0..a3 of m16n8k16 in ldmatrix's register order.
template <int Cols>
__device__ __forceinline__ void load_a_fragment(const bits16* tile, int row0, int col0,
                                                u32* fragment) {
    const int lane = threadIdx.x % 32;
    load_matrix_x4(shared_address(tile + (row0 + lane % 16) * kTilePitch<Cols> + col0 +
                                  (lane / 16) * 8),
                   fragment);
}

// The A fragment (16 x 16) at rows [m0, m0 + 16), columns [k0, k0 + 16) of A = tile^T, for
// a tile stored k-major (tile[k][m], e.g. dS^T when dQ = dS K needs dS): the transposing
// ldmatrix, lanes 0-7 / 8-15 / 16-23 / 24-31 addressing a0..a3's 8 x 8 blocks.
template <int Cols>
__device__ __forceinline__ void load_a_fragment_transposed(const bits16* tile, int m0, int k0,
                                                           u32* fragment) {
    const int lane = threadIdx.x % 32;
    load_matrix_x4_transposed(
        shared_address(tile + (k0 + (lane & 7) + ((lane >> 4) & 1) * 8) * kTilePitch<Cols> +
                       m0 + ((lane >> 3) & 1) * 8),
        fragment);
}

// B fragments of two n8 tiles when B[k][n] = tile[n][k] (the tile's rows are B's
// columns, e.g. K in S = Q K^T): rows [n0, n0 + 16) at columns [k0, k0 + 16);
// b[0], b[1] serve columns n0..n0+7, b[2], b[3] columns n0+8..n0+15.
// (Swizzled tiles load through SwizzledFragments below; this pointer arithmetic is what the
// backward kernels' register allocation was tuned with.)
template <int Cols>
__device__ __forceinline__ void load_b_fragments(const bits16* tile, int n0, int k0, u32* b) {
    const int lane = threadIdx.x % 32;
    load_matrix_x4(shared_address(tile + (n0 + (lane & 7) + ((lane >> 4) << 3)) *
                                             kTilePitch<Cols> +
                                  k0 + ((lane >> 3) & 1) * 8),
                   b);
}

// B fragments of two n8 tiles when B[k][n] = tile[k][n] (e.g. V in O = P V), through the
// transposing ldmatrix: rows [k0, k0 + 16), columns [n0, n0 + 16).
template <int Cols>
__device__ __forceinline__ void load_b_fragments_transposed(const bits16* tile, int k0, int n0,
                                                            u32* b) {
    const int lane = threadIdx.x % 32;
    load_matrix_x4_transposed(
        shared_address(tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * kTilePitch<Cols> +
                       n0 + (lane >> 4) * 8),
        b);
}

// The same two loads from swizzled tiles, through a lane address formed once: the tile's
// shared address (128-byte aligned) plus `lane_offset` (the lane's offset at fragment
// (0, 0)). A fragment's rows start at a multiple of 16, whole periods of the swizzle
// (kRowBases x kGroup = 8 rows), so its rows permute their chunks as rows 0-15 do; and the
// lane's chunk (0 or 1 past an even one) sits in the address bits that chunk XORs, which
// the aligned tile and whole-line row groups leave clear. So fragment (r0, c0) is the
// lane's address XOR c0's low chunk bits, plus a constant: an XOR and an immediate a load,
// where the offset formed anew took ~7 integer instructions (64-bit sums, a shared-window
// conversion) of a decode tile's ~800 (bench/NOTES-gpu.md v55).
template <int Cols>
struct SwizzledFragments {
    static constexpr int kLowChunks = 8 / kRowBases<Cols> - 1;  // the chunk bits a row XORs

    // The lane's byte offset in the tile: load_b_fragments's row and chunk (`transposed`
    // false: rows (lane & 7) + (lane >> 4) * 8, chunk (lane >> 3) & 1) or the transposing
    // load's (rows (lane & 7) + ((lane >> 3) & 1) * 8, chunk lane >> 4).
    __device__ __forceinline__ static u32 lane_offset(bool transposed) {
        const int lane = threadIdx.x % 32;
        const int row = transposed ? (lane & 7) + ((lane >> 3) & 1) * 8
                                   : (lane & 7) + ((lane >> 4) << 3);
        const int col = transposed ? (lane >> 4) * 8 : ((lane >> 3) & 1) * 8;
        return 2 * tile_offset<Cols, true>(row, col);
    }
    // Fragment rows [row0, row0 + 16), chunks [chunk0, chunk0 + 2) (row0 a multiple of 16,
    // chunk0 even) from the lane's address.
    __device__ __forceinline__ static u32 at(u32 lane_address, int row0, int chunk0) {
        return (lane_address ^ ((chunk0 & kLowChunks) << 4)) +
               2 * (row0 * Cols + (chunk0 & ~kLowChunks) * 8);
    }
    // load_b_fragments(tile, n0, k0, b) of the tile whose lane address (lane_offset(false)
    // added) is `lane_address`.
    __device__ __forceinline__ static void load_b(u32 lane_address, int n0, int k0, u32* b) {
        load_matrix_x4(at(lane_address, n0, k0 / 8), b);
    }
    // load_b_fragments_transposed(tile, k0, n0, b), lane_offset(true) added.
    __device__ __forceinline__ static void load_b_transposed(u32 lane_address, int k0, int n0,
                                                             u32* b) {
        load_matrix_x4_transposed(at(lane_address, k0, n0 / 8), b);
    }
};

// The A fragment of a 16 x 16 block of a product whose fp32 accumulators are the n8 tiles
// `left` and `right` (columns 0-7 and 8-15): the accumulator layout of two m16n8 tiles is
// the A layout of m16k16, so a product's result feeds the next product from registers.
__device__ __forceinline__ void pack_a_fragment(const float* left, const float* right,
                                                u32* fragment) {
    fragment[0] = pack_pair(left[0], left[1]);
    fragment[1] = pack_pair(left[2], left[3]);
    fragment[2] = pack_pair(right[0], right[1]);
    fragment[3] = pack_pair(right[2], right[3]);
}
