// Hopper's warpgroup matrix instructions on TF32 operands (K = 8), for the float32 kernels'
// 3xTF32 products (tf32.cuh). An operand is float32 bits, of which the tensor cores read the
// top 19. TF32 has no transposed form: both operands are K-major, so a float tile that is
// the B of one product and would be the MN-major B of another (V in O = P V) is stored
// transposed by its kernel.
//
// A float tile is laid out byte for byte as a 16-bit tile twice as wide (wgmma.cuh's
// Swizzled<2 * Width>): a 128-byte swizzled row holds 32 floats, and a K = 8 slice of floats
// is the 32 bytes a K = 16 slice of 16-bit elements is, so slices, descriptors and copies are
// the 16-bit ones.
#pragma once
#include "wgmma.cuh"

template <int Width> using FloatSwizzled = Swizzled<2 * Width>;

// Byte offset of float (r, c) of a swizzled float tile of `rows` rows and Width columns.
template <int Width>
__device__ __forceinline__ u32 float_element(int r, int c, int rows) {
    return FloatSwizzled<Width>::element(r, 2 * c, rows);
}

// d = A B (+ d when `accumulate`), A and B K-major TF32 tiles in shared memory.
template <int N>
__device__ __forceinline__ void wgmma_ss_tf32(float (&d)[N / 8][4], u64 a, u64 b, int accumulate);
// d = A B (+ d) with A from registers, each warp's 16 rows in the m16n8k8 TF32 A layout
// (a0 = (g, t), a1 = (g + 8, t), a2 = (g, t + 4), a3 = (g + 8, t + 4)), B K-major in shared
// memory.
template <int N>
__device__ __forceinline__ void wgmma_rs_tf32(float (&d)[N / 8][4], const u32 (&a)[4], u64 b,
                                              int accumulate);

// The operand numbers follow wgmma.cuh's WGMMA_SHAPE: after the 4 F accumulators come the
// two descriptors and the flag, or the four A registers, the descriptor and the flag.
#define WGMMA_TF32_SHAPE(N, F, O0, O1, O2, O3, O4, O5)                                     \
    template <>                                                                             \
    __device__ __forceinline__ void wgmma_ss_tf32<N>(float (&d)[F][4], u64 a, u64 b,        \
                                                     int accumulate) {                      \
        asm volatile("{ .reg .pred p; setp.ne.b32 p, " O2 ", 0;\n"                          \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32"              \
                     " {" WGMMA_REGS_##F "}, " O0 ", " O1 ", p, 1, 1; }\n"                  \
                     : WGMMA_ACC_##F                                                        \
                     : "l"(a), "l"(b), "r"(accumulate));                                    \
    }                                                                                       \
    template <>                                                                             \
    __device__ __forceinline__ void wgmma_rs_tf32<N>(float (&d)[F][4], const u32 (&a)[4],   \
                                                     u64 b, int accumulate) {               \
        asm volatile("{ .reg .pred p; setp.ne.b32 p, " O5 ", 0;\n"                          \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32"              \
                     " {" WGMMA_REGS_##F "}, {" O0 ", " O1 ", " O2 ", " O3 "}, " O4         \
                     ", p, 1, 1; }\n"                                                       \
                     : WGMMA_ACC_##F                                                        \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate)); \
    }

WGMMA_FOR_EACH_N(WGMMA_TF32_SHAPE)
