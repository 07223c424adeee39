// The read roofline for decode_costs_gpu.py: every 16-byte chunk of two arrays read once
// (streaming loads, four in flight a thread), nothing written but a guard no input meets.
extern "C" __global__ void stream_read(const uint4* a, long long a_chunks, const uint4* b,
                                       long long b_chunks, unsigned* sink) {
    unsigned folded = 0;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (int which = 0; which < 2; ++which) {
        const uint4* data = which == 0 ? a : b;
        const long long chunks = which == 0 ? a_chunks : b_chunks;
        long long i = first;
        for (; i + 3 * stride < chunks; i += 4 * stride) {
            uint4 x[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) x[u] = __ldcs(data + i + u * stride);
#pragma unroll
            for (int u = 0; u < 4; ++u) folded ^= x[u].x ^ x[u].y ^ x[u].z ^ x[u].w;
        }
        for (; i < chunks; i += stride) {
            const uint4 x = __ldcs(data + i);
            folded ^= x.x ^ x.y ^ x.z ^ x.w;
        }
    }
    if (folded == 0x9E3779B9u) sink[0] = folded;
}
