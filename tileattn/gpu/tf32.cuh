// float32 products on TF32 tensor cores at float32 accuracy ("3xTF32"): each float32
// operand x is split into a TF32 part and the TF32 part of the rest,
//     x = big + small,  big = x with its low 13 mantissa bits cleared (exact: a TF32),
//     small = tf32(x - big)  (x - big is exact; |small| < 2^-10 |x|),
// and a * b is taken as  a_small b_big + a_big b_small + a_big b_big  on
// mma.sync.m16n8k8.tf32 with float32 accumulators. What is left out, a_small b_small and
// the truncation of the small parts, is below 2^-20 |a b| per product (float32's own
// rounding is 2^-24), inside the float32 tolerance of tileattn/testing.py; a single TF32
// product (2^-11 per operand) is not. CUTLASS calls this OpMultiplyAddFastF32; torch's
// memory-efficient attention runs float32 this way on sm_80+.
//
// Fragment layouts of m16n8k8 (g = lane / 4, t = lane % 4): A a0 = (g, t), a1 = (g + 8, t),
// a2 = (g, t + 4), a3 = (g + 8, t + 4); B b0 = (k t, n g), b1 = (k t + 4, n g); C as
// m16n8k16's (forward_softmax.cuh). The kernels relabel k freely (a sum does not care
// about its order): logical k = t, t + 4 of a k8 step are the adjacent elements 2t, 2t + 1,
// so one 64-bit shared load fetches both and a C fragment is already an A fragment.
#pragma once
#include "mma.cuh"

// An operand element as the two TF32 halves the three products take.
struct Tf32Split {
    u32 big;
    u32 small;
};

constexpr u32 kTf32Mask = 0xffffe000u;  // sign, exponent and the top 10 mantissa bits

// x = big + small, two bit operations and a subtraction. An infinite x would have small =
// inf - inf = NaN and turn a score of +-inf (a kept infinite key) into NaN; min(d, max(d, 0))
// is d for every number and 0 for NaN (min and max return their non-NaN operand), so an
// infinite x splits into (x, 0) and its products follow IEEE as SPEC asks. A NaN x keeps
// its NaN in big.
__device__ __forceinline__ Tf32Split split_tf32(float x) {
    Tf32Split split;
    split.big = __float_as_uint(x) & kTf32Mask;
    const float rest = x - __uint_as_float(split.big);
    split.small = __float_as_uint(fminf(rest, fmaxf(rest, 0.0f))) & kTf32Mask;
    return split;
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

// Two adjacent floats of shared memory (8-byte aligned) in one load.
__device__ __forceinline__ void load_shared_pair(const float* pointer, float& low, float& high) {
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                 : "=f"(low), "=f"(high)
                 : "r"(shared_address(pointer)));
}

// The split A fragment of rows [row0, row0 + 16) at the k8 step whose logical k = t, t + 4
// are columns col0 + 2t, col0 + 2t + 1 of a row-major float tile of pitch `Pitch`.
template <int Pitch>
__device__ __forceinline__ void load_split_a_fragment(const float* tile, int row0, int col0,
                                                      u32 (&big)[4], u32 (&small)[4]) {
    const int lane = threadIdx.x % 32;
    const float* top = tile + (row0 + lane / 4) * Pitch + col0 + 2 * (lane % 4);
    float x[4];
    load_shared_pair(top, x[0], x[2]);
    load_shared_pair(top + 8 * Pitch, x[1], x[3]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const Tf32Split split = split_tf32(x[i]);
        big[i] = split.big;
        small[i] = split.small;
    }
}
