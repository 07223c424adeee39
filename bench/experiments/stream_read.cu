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

// The read roofline of a paged decode: block (sequence, kv head, key range) reads its K and
// V rows page by page through a block table, as the decode's tiles do, four 16-byte chunks
// in flight a thread. Pools are (pages, kv heads, page_size, D); a dense (B, Hkv, N, D)
// cache is the same with page_size = N and table[b] = b.
extern "C" __global__ void paged_read(const uint4* k_pool, const uint4* v_pool,
                                      const int* table, int table_stride, long long chunks,
                                      long long page_head_chunks, int n_kv_heads, int splits,
                                      unsigned* sink) {
    // chunks: K chunks of one (sequence, kv head); page_head_chunks: of one page's head
    const int split = blockIdx.x % splits, head = blockIdx.x / splits % n_kv_heads;
    const int batch = blockIdx.x / splits / n_kv_heads;
    const long long begin = chunks * split / splits, end = chunks * (split + 1) / splits;
    const int* pages = table + static_cast<long long>(batch) * table_stride;
    const long long page_chunks = page_head_chunks * n_kv_heads;
    const auto at = [&](long long i) {
        const long long page = pages[i / page_head_chunks];
        return page * page_chunks + head * page_head_chunks + i % page_head_chunks;
    };
    unsigned folded = 0;
    long long i = begin + threadIdx.x;
    const int stride = blockDim.x;
    for (; i + stride < end; i += 2 * stride) {
        const long long a = at(i), b = at(i + stride);
        const uint4 x[4] = {__ldcs(k_pool + a), __ldcs(v_pool + a), __ldcs(k_pool + b),
                            __ldcs(v_pool + b)};
#pragma unroll
        for (int u = 0; u < 4; ++u) folded ^= x[u].x ^ x[u].y ^ x[u].z ^ x[u].w;
    }
    for (; i < end; i += stride) {
        const long long a = at(i);
        const uint4 x = __ldcs(k_pool + a), y = __ldcs(v_pool + a);
        folded ^= x.x ^ x.y ^ x.z ^ x.w ^ y.x ^ y.y ^ y.z ^ y.w;
    }
    if (folded == 0x9E3779B9u) sink[0] = folded;
}

// The read roofline of the decode's own copy pattern (decode_patterns_gpu.py): block
// (sequence, kv head, key range) streams its K and V rows into STAGES shared-memory buffers
// with 16-byte cp.async copies (with L2_PREFETCH, cp.async's L2 prefetch qualifier), one
// barrier a stage, and folds one word of each landed stage. ALTERNATE = 0: a stage holds
// KEYS keys of K and the same keys of V; 1: a stage holds 2 x KEYS keys of K or of V, in
// turn (K tile t, V tile t, K tile t + 1, ...). Rows of ROW_BYTES bytes, dense (B, Hkv, N);
// N a multiple of the keys a tile.
#ifndef STAGES
#define STAGES 2
#define KEYS 64
#define ROW_BYTES 256
#define ALTERNATE 0
#endif
// ZFILL: the copies take a source size (16, or 0 for zeros), as the kernels' do; PAD: bytes
// between rows in shared memory (the kernels pad rows by 16 for ldmatrix).
#ifndef ZFILL
#define ZFILL 0
#endif
#ifndef PAD
#define PAD 0
#endif
#if defined(L2_PREFETCH) && L2_PREFETCH == 128
#define TILE_COPY_PREFIX "cp.async.cg.shared.global.L2::128B [%0], [%1], 16"
#elif defined(L2_PREFETCH) && L2_PREFETCH == 256
#define TILE_COPY_PREFIX "cp.async.cg.shared.global.L2::256B [%0], [%1], 16"
#else
#define TILE_COPY_PREFIX "cp.async.cg.shared.global [%0], [%1], 16"
#endif

__device__ __forceinline__ void tile_copy(unsigned destination, const char* source,
                                          bool valid) {
    if (ZFILL)
        asm volatile(TILE_COPY_PREFIX ", %2;\n" ::"r"(destination), "l"(source),
                     "r"(valid ? 16 : 0));
    else
        asm volatile(TILE_COPY_PREFIX ";\n" ::"r"(destination), "l"(source));
}

extern "C" __global__ void tile_read(const char* k, const char* v, long long n_k, int splits,
                                     unsigned* sink) {
    extern __shared__ __align__(16) char stages[];
    constexpr int kStageBytes = 2 * KEYS * (ROW_BYTES + PAD);
    constexpr int kTileKeys = ALTERNATE ? 2 * KEYS : KEYS;  // keys of K (and V) a tile
    const int split = blockIdx.x % splits;
    const long long sequence = blockIdx.x / splits;  // (batch, kv head)
    const long long tiles = n_k / kTileKeys, begin = tiles * split / splits,
                    end = tiles * (split + 1) / splits;
    const char* k_rows = k + sequence * n_k * ROW_BYTES;
    const char* v_rows = v + sequence * n_k * ROW_BYTES;
    // A stage unit: ALTERNATE, K of tile t then V of tile t (two units a tile); else both.
    const long long units = (ALTERNATE ? 2 : 1) * (end - begin);
    const auto load = [&](long long unit) {
        const unsigned base = static_cast<unsigned>(
            __cvta_generic_to_shared(stages + (unit % STAGES) * kStageBytes));
        const long long tile = begin + (ALTERNATE ? unit / 2 : unit);
        const long long bytes = static_cast<long long>(kTileKeys) * ROW_BYTES;
        const char* first = (ALTERNATE && unit % 2 ? v_rows : k_rows) + tile * bytes;
        const long long rows_left = n_k - tile * kTileKeys;
        for (long long offset = threadIdx.x * 16; offset < bytes; offset += blockDim.x * 16) {
            const long long row = offset / ROW_BYTES;
            const unsigned at = static_cast<unsigned>(row * PAD + offset);
            tile_copy(base + at, first + offset, row < rows_left);
            if (!ALTERNATE)
                tile_copy(base + static_cast<unsigned>(kTileKeys * (ROW_BYTES + PAD)) + at,
                          v_rows + tile * bytes + offset, row < rows_left);
        }
    };
    unsigned folded = 0;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < units) load(s);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    for (long long unit = 0; unit < units; ++unit) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
        __syncthreads();
        if (unit + STAGES - 1 < units) load(unit + STAGES - 1);
        asm volatile("cp.async.commit_group;\n" ::);
        folded ^= reinterpret_cast<const unsigned*>(stages + (unit % STAGES) * kStageBytes)
            [threadIdx.x];
    }
    if (folded == 0x9E3779B9u) sink[0] = folded;
}
