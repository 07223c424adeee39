// float32 products on TF32 tensor cores at float32 accuracy ("3xTF32"): each float32
// operand x is split into a TF32 part and the TF32 part of the rest,
//     x = big + small,  big = x with its low 13 mantissa bits cleared (exact: a TF32),
//     small = tf32(x - big)  (x - big is exact; |small| < 2^-10 |x|),
// and a * b is taken as  a_small b_big + a_big b_small + a_big b_big  on
// mma.sync.m16n8k8.tf32 with float32 accumulators. What is left out, a_small b_small and
// the truncation of the small parts, is below 2^-20 |a b| per product (float32's own
// rounding is 2^-24), inside the float32 tolerance of tileattn/testing.py; a single TF32
// product (2^-11 per operand) is not. CUTLASS calls this OpMultiplyAddFastF32; torch's
// memory-efficient attention runs float32 this way on sm_80+. The tensor cores read only
// the top 19 bits of a TF32 operand (sign, exponent, 10 mantissa bits) and ignore the rest,
// so small is passed as the float x - big itself: on the H200, clearing its low 13 bits
// first gave the same bits in 150 of 150 forwards and backwards (TF32_MASK_SMALL,
// bench/experiments/tf32_split_gpu.py; bench/NOTES-gpu.md v43).
//
// The scores S = Q K^T take big rounded to the nearest TF32 instead (split_tf32 with
// `nearest`): the rest then has at most 12 significant bits, and a score's error falls from
// 2^-22.4 of sum |q_d k_d| on average (2^-19.8 at worst) to 2^-24.6 (2^-21.4), near a naive
// float32 dot product's 2^-25.6 (bench/NOTES-gpu.md v19). At |s| ~ 1e4 that error is what
// P = exp(s - lse) carries into every gradient; in the other products nothing amplifies
// it, and they keep the truncated split. Its price: small may have the sign opposite to
// big, and where |small| > 1 its product with an infinite partner's big part (the largest
// TF32, see split_tf32) overflows to the infinity opposite to IEEE's: +inf and -inf meet
// in a NaN; redo_nan_scores takes such scores again on CUDA cores.
//
// Fragment layouts of m16n8k8 (g = lane / 4, t = lane % 4): A a0 = (g, t), a1 = (g + 8, t),
// a2 = (g, t + 4), a3 = (g + 8, t + 4); B b0 = (k t, n g), b1 = (k t + 4, n g); C as
// m16n8k16's (forward_softmax.cuh). The kernels relabel k freely (a sum does not care
// about its order): logical k = t, t + 4 of a k8 step are the adjacent elements 2t, 2t + 1,
// so one 64-bit shared load fetches both and a C fragment is already an A fragment.
#pragma once
#include "mma.cuh"

#ifndef TF32_MASK_SMALL
#define TF32_MASK_SMALL 0  // 1: clear small's low 13 bits (what the tensor cores ignore)
#endif

// An operand element as the two TF32 halves the three products take.
struct Tf32Split {
    u32 big;
    u32 small;
};

constexpr u32 kTf32Mask = 0xffffe000u;  // sign, exponent and the top 10 mantissa bits

// x = big + small. big is x truncated to TF32, or, where `nearest`, rounded to the nearest
// TF32 (ties away from zero: the rounding bit added to the magnitude's bits, then the low 13
// cleared); magnitudes that would round past the largest TF32 are truncated, so big never
// overflows. The scores pass nearest = true, every other product the default.
// Magnitudes above the largest TF32 (infinities, and NaNs, whose bits are larger still)
// give big that largest TF32 with x's sign, so the rest is the infinity (or a NaN) and
// lands in small: each of the three products of an infinite x with a finite partner b is
// then finite or the infinity of sign(x b), and their sum is IEEE's x b, also where b is a
// TF32 number (small part 0; with x split as (inf, 0), 0 x inf would be NaN), and NaN
// where b is 0. A NaN x keeps a NaN in small, whatever its payload bits. The rest needs
// no NaN guard (a split into (inf, inf - inf) would), so the clamp adds no op to a split.
__device__ __forceinline__ Tf32Split split_tf32(float x, bool nearest = false) {
    constexpr u32 kLargestTf32 = 0x7f7fe000u;
    constexpr u32 kSign = 0x80000000u;
    const u32 bits = __float_as_uint(x);
    // The rounding bit added to the magnitude carries magnitudes from 0x7f7ff000 up (and
    // infinities and NaNs) past the largest TF32; the unsigned min brings them back to it.
    const u32 magnitude =
        min(((bits & ~kSign) + (nearest ? 0x1000u : 0u)) & kTf32Mask, kLargestTf32);
    Tf32Split split;
    split.big = magnitude | (bits & kSign);
    const float rest = x - __uint_as_float(split.big);
#if TF32_MASK_SMALL
    split.small = __float_as_uint(rest) & kTf32Mask;
#else
    split.small = __float_as_uint(rest);  // the tensor cores read its top 19 bits only
#endif
    return split;
}

// Whether some lane of the warp holds a NaN among its accumulators `c` (any shape of floats).
template <typename Accumulators>
__device__ __forceinline__ bool warp_has_nan(const Accumulators& c) {
    const float* values = reinterpret_cast<const float*>(&c);
    bool nan = false;
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(Accumulators) / sizeof(float)); ++i)
        nan = nan || values[i] != values[i];
    return __any_sync(0xffffffffu, nan);
}

// The scores among this warp's C fragments `tile` (rows row0 + g and row0 + g + 8 of the
// row-major tile a, columns n * 8 + 2t and + 1 of fragment n: rows of b) that came out NaN,
// taken again as float32 dot products over Width columns on CUDA cores, in IEEE arithmetic:
// split to nearest, an infinite operand can meet its partner's small part of the other sign
// (see the top), and IEEE's +-inf (or NaN) is what the golden model has there. Only
// non-finite inputs make a NaN score, so other warps pay one vote.
template <int Pitch, int Width, int Fragments>
__device__ __forceinline__ void redo_nan_scores(float (&tile)[Fragments][4], const float* a,
                                                const float* b, int row0) {
    if (!warp_has_nan(tile)) return;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int n = 0; n < Fragments; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (tile[n][e] == tile[n][e]) continue;
            const float* a_row = a + (row0 + lane / 4 + (e / 2) * 8) * Pitch;
            const float* b_row = b + (n * 8 + 2 * (lane % 4) + e % 2) * Pitch;
            float dot = 0.0f;
#pragma unroll 1
            for (int d = 0; d < Width; ++d) dot = fmaf(a_row[d], b_row[d], dot);
            tile[n][e] = dot;
        }
}

// c += a * b for one m16n8k8 tile of TF32 operands, float32 accumulators.
__device__ __forceinline__ void mma_16x8x8_tf32(float* c, const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a * b at float32 accuracy from split operands; the small products go first, while
// c is still small, so that they lose the fewest bits to its rounding. Transposed: this
// product is the transpose of one taken with the operands swapped (the backward's
// S^T = K Q^T of the forward's S = Q K^T), so its cross terms go in the swapped order and
// each element is the same sequence of roundings, the same float: P = exp(S - lse) of a
// dominant key then comes out 1 in the dK/dV kernel too (the large-score test).
template <bool Transposed = false>
__device__ __forceinline__ void mma_16x8x8_3xtf32(float* c, const u32 (&a_big)[4],
                                                  const u32 (&a_small)[4], Tf32Split b0,
                                                  Tf32Split b1) {
    if constexpr (Transposed) {
        mma_16x8x8_tf32(c, a_big, b0.small, b1.small);
        mma_16x8x8_tf32(c, a_small, b0.big, b1.big);
    } else {
        mma_16x8x8_tf32(c, a_small, b0.big, b1.big);
        mma_16x8x8_tf32(c, a_big, b0.small, b1.small);
    }
    mma_16x8x8_tf32(c, a_big, b0.big, b1.big);
}

// The scores' k8 steps are taken kScoreChunk at a time into a zero tile, which is then
// added to the score in IEEE float32 on CUDA cores. The tensor cores' float32
// accumulation does not round as IEEE's, and over a head dim of k8 steps into one
// accumulator it gave scores whose error, amplified by P = exp(s - lse) at |s| ~ 100, took
// the float32 backward to 2-3x a naive float32 backward's error
// (bench/experiments/float32_backward_accuracy_gpu.py, NOTES-gpu v21). The forward and
// both backward kernels take the same chunks in the same order, so a score is the same
// float in each (the large-score test). Eight steps a chunk: on the H100 (D = 128, scale
// 2.5) the worst backward error fell from 3.29x the float32 tolerance to 1.96x (a naive
// float32 backward: 2.94x; four steps a chunk 1.60x, one step 1.43x) for 7 % of the
// float32 forward at D = 128 (four steps cost 12 %, one step 20 %; NOTES-gpu v21, v23).
constexpr int kScoreChunk = 8;

// The other products (P V, P^T dO, dS^T Q, dS K) add a tile's terms to a sum over every
// tile of the row (O) or of the column (dK, dV, dQ). Accumulated in place on the tensor
// cores, each small term added to a large sum lost a little, always toward zero: a causal
// key's dV (most of it from the rows next to the key, the rest from thousands of rows
// after them) reached 12x the float32 tolerance at N = 16k, an attention sink's O 1x
// (bench/experiments/ring_accuracy_gpu.py, NOTES-gpu v24). They too go kProductChunk k8
// steps at a time into a zero tile added in IEEE float32.
constexpr int kProductChunk = 8;

// A chunk's products into one zero tile form a chain of dependent mma instructions; a
// chunk takes kChunkChains output tiles at a time, so that as many chains interleave.
constexpr int kChunkChains = 8;

// Two adjacent floats of shared memory (8-byte aligned) in one load.
__device__ __forceinline__ void load_shared_pair(const float* pointer, float& low, float& high) {
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                 : "=f"(low), "=f"(high)
                 : "r"(shared_address(pointer)));
}

// The split A fragment of rows [row0, row0 + 16) at the k8 step whose logical k = t, t + 4
// are columns col0 + 2t, col0 + 2t + 1 of a row-major float tile of pitch `Pitch`, split
// as split_tf32(x, nearest).
template <int Pitch>
__device__ __forceinline__ void load_split_a_fragment(const float* tile, int row0, int col0,
                                                      u32 (&big)[4], u32 (&small)[4],
                                                      bool nearest = false) {
    const int lane = threadIdx.x % 32;
    const float* top = tile + (row0 + lane / 4) * Pitch + col0 + 2 * (lane % 4);
    float x[4];
    load_shared_pair(top, x[0], x[2]);
    load_shared_pair(top + 8 * Pitch, x[1], x[3]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const Tf32Split split = split_tf32(x[i], nearest);
        big[i] = split.big;
        small[i] = split.small;
    }
}
