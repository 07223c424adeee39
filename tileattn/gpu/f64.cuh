// float64 products on sm_90's FP64 tensor cores: mma.sync.m16n8k8.row.col.f64 takes the
// fragment layouts of m16n8k8.tf32 (tf32.cuh: A a0 = (g, t), a1 = (g + 8, t), a2 = (g, t + 4),
// a3 = (g + 8, t + 4); B b0 = (k t, n g), b1 = (k t + 4, n g); C as m16n8k16's), in doubles.
// The kernels relabel k as the 3xTF32 ones do (logical k = t, t + 4 are columns 2t, 2t + 1),
// so a fragment's pair of a row is one 16-byte shared load and a C fragment is an A
// fragment. sm_80 has only m8n8k4.f64 (nvcc refuses this shape below sm_90).
#pragma once
#include "mma.cuh"

// c += a b for one m16n8k8 tile of doubles: each element one chain of IEEE fp64 fused
// multiply-adds, as a dot product on CUDA cores would be (to the order of its terms).
__device__ __forceinline__ void mma_16x8x8_f64(double (&c)[4], const double (&a)[4], double b0,
                                               double b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
        : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b0), "d"(b1));
}

// Two adjacent doubles of shared memory (16-byte aligned) in one load.
__device__ __forceinline__ void load_shared_pair(const double* pointer, double& low,
                                                 double& high) {
    asm volatile("ld.shared.v2.f64 {%0, %1}, [%2];\n"
                 : "=d"(low), "=d"(high)
                 : "r"(shared_address(pointer)));
}

// The A fragment of rows [row0, row0 + 16) at the k8 step whose logical k = t, t + 4 are
// columns col0 + 2t, col0 + 2t + 1 of a row-major double tile of pitch `Pitch`: a0, a2 one
// 16-byte load of row g, a1, a3 one of row g + 8.
template <int Pitch>
__device__ __forceinline__ void load_a_fragment_f64(const double* tile, int row0, int col0,
                                                    double (&a)[4]) {
    const int lane = threadIdx.x % 32;
    const double* top = tile + (row0 + lane / 4) * Pitch + col0 + 2 * (lane % 4);
    load_shared_pair(top, a[0], a[2]);
    load_shared_pair(top + 8 * Pitch, a[1], a[3]);
}
