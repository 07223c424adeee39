// Tensor-core backward for float16 / bfloat16, any D and Dv up to 256 (sm_80 and later).
//
// FlashAttention-2 backward (Algorithm 2) on mma.sync.m16n8k16, split in two kernels so
// that nothing is accumulated by atomics (deterministic, and no float32 dQ buffer):
//
// * attention_backward_dq_mma: one block per (batch, head, OWNED_ROWS query rows), each
//   warp owning 16 rows, streaming STREAMED_ROWS-key tiles of K and V: S = Q K^T and
//   dP = dO V^T, then dQ += dS K, dS fed from the accumulators as the A operand.
//   D = rowsum(dO * o) comes from attention_backward_delta.cu, launched before both.
// * attention_backward_dkdv_mma: one block per (batch, kv head, OWNED_ROWS keys), each
//   warp owning 16 keys, streaming STREAMED_ROWS-query tiles of Q, dO, lse and D for every
//   query head of its GQA group (so dK/dV sum the group in registers). It computes the
//   transposed tiles S^T = K Q^T and dP^T = V dO^T directly: P^T and dS^T are then
//   accumulator fragments of rows = keys, which are exactly the A operands of
//   dV += P^T dO and dK += dS^T Q. No score tile goes through shared memory.
//
// SINGLE_PASS: no dQ kernel; the dK/dV kernel also adds each query tile's dQ share, dS K
// over its keys, into a float32 buffer (FA2's single pass): 5 tile products instead of 7.
// Without ORDERED (deterministic=False) the additions land in whatever order the blocks
// reach them. With ORDERED the key blocks of a head take turns on each query tile through
// a counter per (head, query tile), in ascending order of the key blocks, so dq is
// bitwise reproducible; blocks that run together trail each other by a turn
// (backward_single_pass.cuh: dq_turn_rank). dS goes through shared memory, as the dQ
// product needs it with queries as rows; attention_backward_dq_convert scales and rounds
// the buffer into dq. With DQ_PARTS (not with ORDERED) each key block stores its shares
// into a slot of its own, (batch x head, key block, Nq, D) floats, and
// attention_backward_dq_convert sums a head's slots in the order of its key blocks:
// reproducible without turns, for few query rows (the slots are key blocks x Nq x D).
//
// Both kernels double-buffer the streamed tiles with cp.async (tile t + 1 in flight while
// t is multiplied), skip tiles outside the band and evaluate the per-score mask only on
// tiles that straddle its edge (or the end of the keys). Probabilities are recomputed
// from lse in the forward's logit units (mma.cuh: base 2, natural for IS_FLOAT32;
// ex2.approx); P (after dropout) and dS are rounded to the input type for the tensor cores,
// accumulation is float32.
//
// IS_FLOAT32: the same kernels for float32 on TF32 tensor cores at float32 accuracy
// (3xTF32, tf32.cuh). Its single pass keeps dS in shared memory as float32 with queries as
// rows (store_scores_by_query), so that the dQ share loads it as split A fragments.
// IS_FLOAT64: the two kernels for float64 on sm_90's FP64 tensor cores (f64.cuh), doubles
// throughout (lse and D included), rows of the width + 4 doubles (the score products' 16-byte
// loads of rows g, g + 1 and the other products' 8-byte loads of rows 2t, 2t + 1 each meet
// at most two to a bank); its dQ key shares in double parts, its cut groups' in doubles as
// any dtype's; not the single pass (its dQ sum is float32) or warp pairs.
//
// DKDV_PART (as in attention_wgmma_backward.cu): 1 runs only the dV half of the dK/dV
// kernel, 2 only the dK half, 0 both; wide head dims split so that each half's accumulators
// fit the registers. Head dims are zero-padded in shared memory to the tensor cores' K step.
// PAIRED_WARPS (DKDV_PART 0): two warps a 16 owned rows, so
// that wide head dims run twice the warps an SM (each warp holds half the accumulators).
// dK/dV: the first warp of a pair holds dV, the second dK, in one launch instead of two
// that each compute S^T; the first computes S^T and hands it to the second through
// shared memory (publish_scores) while the second computes dP^T; each then adds one
// product. dQ: the first computes S, the second dP, turns S into dS and hands it back;
// each adds dS K over its half of dQ's columns (kDqColumns).
//
// Compile-time configuration (NVRTC -D options): IS_BFLOAT16, IS_FLOAT32, IS_FLOAT64, HEAD_DIM,
// VALUE_DIM, COPY_BYTES, OWNED_ROWS, STREAMED_ROWS, SINGLE_PASS, ORDERED, DQ_PARTS, DKDV_PART,
// PAIRED_WARPS (default 0) and
// QUERY_TAIL (dK/dV kernel; QUERY_TAIL, default 0: a streamed query tile may end past n_q,
// backward_scores.cuh), FLAG_NON_FINITE_KEYS (16-bit dK/dV kernel, default 0; the same
// tail, kept_products.cuh: flag_non_finite_keys), LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, ALIBI,
// DROPOUT, VARLEN (sequences.cuh; not with SINGLE_PASS), GROUP_SPLITS (dK/dV kernel,
// default 1: a GQA group's query heads cut over blocks, attention_wgmma_backward.cu says how),
// STRIDED_OUT (sequences.cuh: the gradients at the strides the kernels' last arguments give;
// not with SPLIT_KEYS or GROUP_SPLITS, whose outputs are contiguous parts; the single pass
// writes dk and dv so, and attention_backward_dq_convert_strided dq).
#include "backward_scores.cuh"
#include "kept_products.cuh"
#ifndef QUERY_TAIL
#define QUERY_TAIL 0
#endif
#ifndef FLAG_NON_FINITE_KEYS
#define FLAG_NON_FINITE_KEYS 0
#endif
#ifndef PAIRED_WARPS
#define PAIRED_WARPS 0
#endif
#ifndef GROUP_SPLITS
#define GROUP_SPLITS 1  // as in attention_wgmma_backward.cu
#endif
#ifndef DQ_PARTS
#define DQ_PARTS 0
#endif
static_assert(!DQ_PARTS || (SINGLE_PASS && !ORDERED), "parts are the single pass's, no turns");
#ifndef IS_FLOAT64
#define IS_FLOAT64 0
#endif
static_assert(!(FLAG_NON_FINITE_KEYS && IS_FLOAT32), "float32 zeroes its tail (QUERY_TAIL)");
static_assert(!(IS_FLOAT64 && (SINGLE_PASS || PAIRED_WARPS || FLAG_NON_FINITE_KEYS)),
              "float64 runs the two kernels (the single pass's dQ sum is float32)");
#if IS_FLOAT64
#include "f64.cuh"
typedef double element;
typedef double accum;  // accumulators, lse, D and the score options
constexpr int kHeadWidth = padded_width(HEAD_DIM, 8);
constexpr int kValueWidth = padded_width(VALUE_DIM, 8);
template <int Width> constexpr int kPitchOf = Width + 4;
#elif IS_FLOAT32
#include "tf32.cuh"
// float32 on TF32 tensor cores at float32 accuracy (tf32.cuh): rows of the width + 8 floats,
// so that the 64-bit fragment loads of the score products are conflict-free.
typedef float element;
typedef float accum;
constexpr int kHeadWidth = padded_width(HEAD_DIM, 8);
constexpr int kValueWidth = padded_width(VALUE_DIM, 8);
template <int Width> constexpr int kPitchOf = Width + 8;
#else
typedef bits16 element;
typedef float accum;
constexpr int kHeadWidth = padded_width(HEAD_DIM, 16);
constexpr int kValueWidth = padded_width(VALUE_DIM, 16);
template <int Width> constexpr int kPitchOf = kTilePitch<Width>;
#endif
// Row pitches of the Q / K (head width) and dO / V (value width) tiles.
constexpr int kQkPitch = kPitchOf<kHeadWidth>;
constexpr int kVPitch = kPitchOf<kValueWidth>;

// A slab is 16 owned rows: one warp's, or one pair's (PAIRED_WARPS pairs both kernels of
// the module it compiles; the launcher runs one kernel a module).
constexpr int kSlabs = OWNED_ROWS / 16;
constexpr int kWarps = kSlabs * (PAIRED_WARPS ? 2 : 1);
constexpr int kThreads = kWarps * 32;
static_assert(OWNED_ROWS % 16 == 0 && STREAMED_ROWS % 16 == 0, "mma tiles");
static_assert(!SINGLE_PASS || (DKDV_PART == 0 &&
                               (IS_FLOAT32 ? HEAD_DIM % 8 == 0
                                           : HEAD_DIM == VALUE_DIM && HEAD_DIM % 16 == 0)),
              "the single pass serves dK and dV in one kernel, D a multiple of 8 (float32) "
              "or D = Dv, multiples of 16");
static_assert(!PAIRED_WARPS || DKDV_PART == 0, "a dK/dV pair holds both halves");
// The columns of a dK/dV warp's accumulator tile: a pair's warps run one code path over
// one tile, dK's or dV's (the narrower half leaves the last columns unused).
constexpr int kDkHeld = PAIRED_WARPS && kValueWidth > kHeadWidth ? kValueWidth : kHeadWidth;
constexpr int kDvHeld = PAIRED_WARPS && kHeadWidth > kValueWidth ? kHeadWidth : kValueWidth;
// The dQ kernel's columns of dQ a warp (PAIRED_WARPS: the first of a pair's, the second
// holds the rest), whole tensor-core steps of the product dS K.
constexpr int kDqStep = IS_FLOAT32 || IS_FLOAT64 ? 8 : 16;
constexpr int kDqColumns =
    PAIRED_WARPS ? (kHeadWidth / 2 + kDqStep - 1) / kDqStep * kDqStep : kHeadWidth;
// What the block computes (each of its warps, without PAIRED_WARPS).
constexpr bool kComputesDv = DKDV_PART != 2;
constexpr bool kComputesDk = DKDV_PART != 1;

// ------------------------------------------------------------------ products

template <int Columns> struct Accumulators {
    accum tile[Columns / 8][4];
    __device__ __forceinline__ void clear() {
#pragma unroll
        for (int n = 0; n < Columns / 8; ++n)
            tile[n][0] = tile[n][1] = tile[n][2] = tile[n][3] = accum(0);
    }
};

// first += A1 B1^T and second += A2 B2^T for this warp's 16 rows [row0, row0 + 16) of the
// row-major tiles a1, a2 (HEAD_DIM wide) against the Columns rows of b1, b2: S and dP (or
// their transposes) in one sweep over the head dim.
#if IS_FLOAT64
// out += A B^T over Width columns for this warp's 16 rows of a and the Columns rows of b
// (Transposed changes nothing: one IEEE product a step).
template <bool Transposed, int Width, int Columns>
__device__ __forceinline__ void score_product(const double* a, const double* b, int row0,
                                              Accumulators<Columns>& out) {
    const int lane = threadIdx.x % 32;
    constexpr int kPitch = kPitchOf<Width>;
#pragma unroll
    for (int kk = 0; kk < Width / 8; ++kk) {
        double a_fragment[4];
        load_a_fragment_f64<kPitch>(a, row0, kk * 8, a_fragment);
#pragma unroll
        for (int n = 0; n < Columns / 8; ++n) {
            double b0, b1;
            load_shared_pair(b + (n * 8 + lane / 4) * kPitch + kk * 8 + 2 * (lane % 4), b0, b1);
            mma_16x8x8_f64(out.tile[n], a_fragment, b0, b1);
        }
    }
}

template <bool Transposed = false, int Columns>
__device__ __forceinline__ void one_score_product(const double* a1, const double* b1, int row0,
                                                  Accumulators<Columns>& first) {
    first.clear();
    score_product<Transposed, kHeadWidth>(a1, b1, row0, first);
}

template <bool Transposed = false, int Columns>
__device__ __forceinline__ void value_score_product(const double* a2, const double* b2,
                                                    int row0, Accumulators<Columns>& second) {
    second.clear();
    score_product<Transposed, kValueWidth>(a2, b2, row0, second);
}

// out[:, 0:Columns) += X B[:, column0:column0 + Columns), X this warp's 16 x Inner
// accumulators (fragment `step` of X is the A fragment of k8 step `step`, its elements
// reordered) and B the row-major Inner x Width tile `b`: B's b0, b1 are rows 2t, 2t + 1.
template <int Columns, int Width, int Inner, int Held>
__device__ __forceinline__ void accumulate_columns(const Accumulators<Inner>& x, const double* b,
                                                   int column0, Accumulators<Held>& out) {
    static_assert(Columns <= Held && Columns % 8 == 0, "whole n8 tiles of out");
    constexpr int kPitch = kPitchOf<Width>;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int step = 0; step < Inner / 8; ++step) {
        const double a[4] = {x.tile[step][0], x.tile[step][2], x.tile[step][1],
                             x.tile[step][3]};
        const double* rows = b + (step * 8 + 2 * (lane % 4)) * kPitch + lane / 4 + column0;
#pragma unroll
        for (int dn = 0; dn < Columns / 8; ++dn)
            mma_16x8x8_f64(out.tile[dn], a, rows[dn * 8], rows[kPitch + dn * 8]);
    }
}
#elif IS_FLOAT32
// out += A B^T over Width columns for this warp's 16 rows of a and the Columns rows of b,
// truncated splits (dP = dO V^T); Transposed: the dK/dV kernel's dP^T = V dO^T, whose
// elements then round as the dQ kernel's (mma_16x8x8_3xtf32, tf32.cuh).
template <bool Transposed, int Width, int Columns>
__device__ __forceinline__ void score_product(const float* a, const float* b, int row0,
                                              Accumulators<Columns>& out) {
    const int lane = threadIdx.x % 32;
    constexpr int kPitch = kPitchOf<Width>;
    // The single pass's step (five products, the dS tile, dQ's additions) outgrew the
    // instruction cache once fully unrolled: warps waited on instruction fetches more
    // than on anything but their own dependences. This product's k loop, rolled, takes
    // 1/16 of its code (bench/NOTES-gpu.md, v41); the two-kernel backward keeps it unrolled.
    constexpr int kUnroll = SINGLE_PASS ? 1 : Width / 8;
#pragma unroll (kUnroll)
    for (int kk = 0; kk < Width / 8; ++kk) {
        u32 a_big[4], a_small[4];
        load_split_a_fragment<kPitch>(a, row0, kk * 8, a_big, a_small);
#pragma unroll
        for (int n = 0; n < Columns / 8; ++n) {
            float b0, b1;
            load_shared_pair(b + (n * 8 + lane / 4) * kPitch + kk * 8 + 2 * (lane % 4), b0, b1);
            mma_16x8x8_3xtf32<Transposed>(out.tile[n], a_big, a_small, split_tf32(b0),
                                          split_tf32(b1));
        }
    }
}

// out = A B^T for the scores S (Transposed: the dK/dV kernel's S^T = K Q^T): operands split
// to nearest, kScoreChunk k8 steps at a time into a zero tile added to out in IEEE
// float32, as the forward's scores, so that each score is the same float (tf32.cuh).
template <bool Transposed, int Width, int Columns>
__device__ __forceinline__ void chunked_score_product(const float* a, const float* b, int row0,
                                                      Accumulators<Columns>& out) {
    const int lane = threadIdx.x % 32;
    constexpr int kPitch = kPitchOf<Width>, kSteps = Width / 8;
#pragma unroll
    for (int k0 = 0; k0 < kSteps; k0 += kScoreChunk) {
        u32 a_big[kScoreChunk][4], a_small[kScoreChunk][4];
#pragma unroll
        for (int c = 0; c < kScoreChunk; ++c)
            if (k0 + c < kSteps)
                load_split_a_fragment<kPitch>(a, row0, (k0 + c) * 8, a_big[c], a_small[c], true);
#pragma unroll
        for (int n0 = 0; n0 < Columns / 8; n0 += kChunkChains) {
            float chunk[kChunkChains][4] = {};
#pragma unroll
            for (int c = 0; c < kScoreChunk; ++c) {
                if (k0 + c >= kSteps) continue;
#pragma unroll
                for (int j = 0; j < kChunkChains; ++j) {
                    if (n0 + j >= Columns / 8) continue;
                    float b0, b1;
                    load_shared_pair(b + ((n0 + j) * 8 + lane / 4) * kPitch + (k0 + c) * 8 +
                                         2 * (lane % 4), b0, b1);
                    mma_16x8x8_3xtf32<Transposed>(chunk[j], a_big[c], a_small[c],
                                                  split_tf32(b0, true), split_tf32(b1, true));
                }
            }
#pragma unroll
            for (int j = 0; j < kChunkChains; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (n0 + j < Columns / 8) out.tile[n0 + j][e] += chunk[j][e];
        }
    }
}

// first = A1 B1^T, the scores S (or S^T), split to nearest as the forward's; NaN scores
// again on CUDA cores (an infinite input; tf32.cuh).
template <bool Transposed, int Columns>
__device__ __forceinline__ void scores_product(const float* a1, const float* b1, int row0,
                                               Accumulators<Columns>& first) {
    first.clear();
    chunked_score_product<Transposed, kHeadWidth>(a1, b1, row0, first);
    redo_nan_scores<kQkPitch, kHeadWidth>(first.tile, a1, b1, row0);
}

template <bool Transposed = false, int Columns>
__device__ __forceinline__ void one_score_product(const float* a1, const float* b1, int row0,
                                                  Accumulators<Columns>& first) {
    scores_product<Transposed>(a1, b1, row0, first);
}

// second = A2 B2^T, dP (or dP^T) alone.
template <bool Transposed = false, int Columns>
__device__ __forceinline__ void value_score_product(const float* a2, const float* b2, int row0,
                                                    Accumulators<Columns>& second) {
    second.clear();
    score_product<Transposed, kValueWidth>(a2, b2, row0, second);
}

// out[:, 0:Columns) += A B[:, column0:column0 + Columns) for this warp's 16 rows of A over
// Steps k8 steps, `split_a(step, big, small)` giving a step's split A fragment, and B the
// row-major (8 Steps) x Width tile `b`, each element taken as `b_value(element)`: a C
// fragment's columns 2t, 2t + 1 are the A fragment's k = t, t + 4 (tf32.cuh), so B's b0, b1
// are rows 2t, 2t + 1; kProductChunk k8 steps at a time into a zero tile added to out in
// IEEE float32 (tf32.cuh).
template <int Columns, int Width, int Steps, int Held, class SplitA, class BValue>
__device__ __forceinline__ void accumulate_split_columns(SplitA split_a, BValue b_value,
                                                         const float* b, int column0,
                                                         Accumulators<Held>& out) {
    static_assert(Columns <= Held && Columns % 8 == 0, "whole n8 tiles of out");
    constexpr int kPitch = kPitchOf<Width>;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int c0 = 0; c0 < Steps; c0 += kProductChunk) {
        u32 a_big[kProductChunk][4], a_small[kProductChunk][4];
#pragma unroll
        for (int c = 0; c < kProductChunk; ++c)
            if (c0 + c < Steps) split_a(c0 + c, a_big[c], a_small[c]);
#pragma unroll
        for (int dn0 = 0; dn0 < Columns / 8; dn0 += kChunkChains) {
            float chunk[kChunkChains][4] = {};
#pragma unroll
            for (int c = 0; c < kProductChunk; ++c) {
                if (c0 + c >= Steps) continue;
                const float* rows = b + ((c0 + c) * 8 + 2 * (lane % 4)) * kPitch + lane / 4 +
                                    column0 + dn0 * 8;
#pragma unroll
                for (int j = 0; j < kChunkChains; ++j)
                    if (dn0 + j < Columns / 8)
                        mma_16x8x8_3xtf32(chunk[j], a_big[c], a_small[c],
                                          split_tf32(b_value(rows[j * 8])),
                                          split_tf32(b_value(rows[kPitch + j * 8])));
            }
#pragma unroll
            for (int j = 0; j < kChunkChains; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (dn0 + j < Columns / 8) out.tile[dn0 + j][e] += chunk[j][e];
        }
    }
}

// out[:, 0:Columns) += X B[:, column0:column0 + Columns), X this warp's 16 x Inner
// accumulators (a C fragment is an A fragment, its elements reordered).
template <int Columns, int Width, int Inner, int Held>
__device__ __forceinline__ void accumulate_columns(const Accumulators<Inner>& x, const float* b,
                                                   int column0, Accumulators<Held>& out) {
    accumulate_split_columns<Columns, Width, Inner / 8>(
        [&](int step, u32(&big)[4], u32(&small)[4]) {
            const float* tile = x.tile[step];
            const float p[4] = {tile[0], tile[2], tile[1], tile[3]};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const Tf32Split split = split_tf32(p[i]);
                big[i] = split.big;
                small[i] = split.small;
            }
        },
        [](float element) { return element; }, b, column0, out);
}
#else
// out += A B^T over Width columns for this warp's 16 rows of a and the Columns rows of b.
template <int Width, int Columns>
__device__ __forceinline__ void score_product(const bits16* a, const bits16* b, int row0,
                                              Accumulators<Columns>& out) {
#pragma unroll
    for (int kk = 0; kk < Width / 16; ++kk) {
        u32 a_fragment[4];
        load_a_fragment<Width>(a, row0, kk * 16, a_fragment);
#pragma unroll
        for (int nn = 0; nn < Columns / 16; ++nn) {
            u32 b_fragments[4];
            load_b_fragments<Width>(b, nn * 16, kk * 16, b_fragments);
            mma_16x8x16(out.tile[2 * nn], a_fragment, b_fragments[0], b_fragments[1]);
            mma_16x8x16(out.tile[2 * nn + 1], a_fragment, b_fragments[2], b_fragments[3]);
        }
    }
}

// Transposed is the float32 kernels' (above); one 16-bit mma has no order to choose.
template <bool Transposed = false, int Columns>
__device__ __forceinline__ void one_score_product(const bits16* a1, const bits16* b1, int row0,
                                                  Accumulators<Columns>& first) {
    first.clear();
    score_product<kHeadWidth>(a1, b1, row0, first);
}

template <bool Transposed = false, int Columns>
__device__ __forceinline__ void value_score_product(const bits16* a2, const bits16* b2,
                                                    int row0, Accumulators<Columns>& second) {
    second.clear();
    score_product<kValueWidth>(a2, b2, row0, second);
}

// out[:, 0:Columns) += X B[:, column0:column0 + Columns) for X = this warp's 16 x Inner
// accumulators (rounded to the input type) and B = the row-major Inner x Width tile `b`.
template <int Columns, int Width, int Inner, int Held>
__device__ __forceinline__ void accumulate_columns(const Accumulators<Inner>& x,
                                                   const bits16* b, int column0,
                                                   Accumulators<Held>& out) {
    static_assert(Columns <= Held && Columns % 16 == 0, "whole k16 tiles of out");
#pragma unroll
    for (int kk = 0; kk < Inner / 16; ++kk) {
        u32 a[4];
        pack_a_fragment(x.tile[2 * kk], x.tile[2 * kk + 1], a);
#pragma unroll
        for (int dn = 0; dn < Columns / 16; ++dn) {
            u32 fragments[4];
            load_b_fragments_transposed<Width>(b, kk * 16, column0 + dn * 16, fragments);
            mma_16x8x16(out.tile[2 * dn], a, fragments[0], fragments[1]);
            mma_16x8x16(out.tile[2 * dn + 1], a, fragments[2], fragments[3]);
        }
    }
}
#endif

// first = A1 B1^T (S or S^T) and second = A2 B2^T (dP or dP^T).
template <bool Transposed = false, int Columns>
__device__ __forceinline__ void two_score_products(const element* a1, const element* b1,
                                                   const element* a2, const element* b2,
                                                   int row0, Accumulators<Columns>& first,
                                                   Accumulators<Columns>& second) {
    one_score_product<Transposed>(a1, b1, row0, first);
    value_score_product<Transposed>(a2, b2, row0, second);
}

// Rows [row0, row0 + 16) of this warp's accumulators, times `factor`, into the output rows
// `out` (row indices relative to its row 0) at columns from `column0`; rows at or past
// `row_limit` and columns at or past Dim are not written.
template <int Dim, int Width, typename Out>
__device__ __forceinline__ void store_rows(const Accumulators<Width>& acc, accum factor,
                                           OutputRows<Out> out, i64 row0, i64 row_limit,
                                           int column0 = 0) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const i64 row = row0 + lane / 4 + half * 8;
        if (row >= row_limit) continue;
#pragma unroll
        for (int n = 0; n < Width / 8; ++n)
            if (column0 + n * 8 < Dim)
                store_row_pair<Dim>(out.row0 + row * out.stride, column0 + n * 8 + 2 * (lane % 4),
                                    acc.tile[n][2 * half] * factor,
                                    acc.tile[n][2 * half + 1] * factor);
    }
}

// Streams tiles [tile_begin, tile_end) through two shared-memory stages: `load(stage,
// tile)` issues a tile's cp.async copies (the caller has issued and committed the first
// one into stage 0), `body(stage, tile)` uses it. Tile t + 1 is in flight during body(t);
// the barrier after body frees its stage for the copy issued next iteration.
template <class Load, class Body>
__device__ __forceinline__ void stream_tiles(i64 tile_begin, i64 tile_end, Load load,
                                             Body body) {
    for (i64 tile = tile_begin; tile < tile_end; ++tile) {
        const int stage = static_cast<int>((tile - tile_begin) & 1);
        if (tile + 1 < tile_end) {
            load(stage ^ 1, tile + 1);
            commit_copies();
            wait_copies<1>();
        } else {
            wait_copies<0>();
        }
        __syncthreads();
        body(stage, tile);
        __syncthreads();
    }
}

// PAIRED_WARPS: slab `slab`'s S^T tile (keys x STREAMED_ROWS queries, accumulator layout)
// from its dV warp to its dK warp, stored [slab][fragment element][lane] so that the 32
// lanes' stores and loads are conflict-free.
constexpr int kPairedScores = STREAMED_ROWS / 8 * 4;  // floats a lane
__device__ __forceinline__ void publish_scores(const Accumulators<STREAMED_ROWS>& st,
                                               float* exchange, int slab) {
    float* out = exchange + slab * kPairedScores * 32 + threadIdx.x % 32;
#pragma unroll
    for (int n = 0; n < STREAMED_ROWS / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) out[(n * 4 + e) * 32] = st.tile[n][e];
}

__device__ __forceinline__ void take_scores(Accumulators<STREAMED_ROWS>& st,
                                            const float* exchange, int slab) {
    const float* in = exchange + slab * kPairedScores * 32 + threadIdx.x % 32;
#pragma unroll
    for (int n = 0; n < STREAMED_ROWS / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) st.tile[n][e] = in[(n * 4 + e) * 32];
}

// ------------------------------------------------------------------ single pass
#if SINGLE_PASS
#include "backward_single_pass.cuh"
#endif

// ------------------------------------------------------------------ dQ

extern "C" __global__ void __launch_bounds__(kThreads) attention_backward_dq_mma(
    const element* q, const element* k, const element* v, const element* d_out, const accum* lse,
    const accum* delta, element* dq, const double* alibi_slopes, i64 n_q_total, i64 n_k_total,
    int n_q_heads, int group_size, i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
    i64 v_sb, i64 v_sh, i64 v_sn, i64 do_sb, i64 do_sh, i64 do_sn, SCORE_OPTION_PARAMS,
    SEQUENCE_PARAMETERS, i64 dq_sb, i64 dq_sh, i64 dq_sn) {
    extern __shared__ __align__(16) element shared_tiles[];
    element* q_tile = shared_tiles;                             // [OWNED_ROWS][kQkPitch]
    element* do_tile = q_tile + OWNED_ROWS * kQkPitch;          // [OWNED_ROWS][kVPitch]
    element* k_tiles = do_tile + OWNED_ROWS * kVPitch;          // [2][STREAMED_ROWS][kQkPitch]
    element* v_tiles = k_tiles + 2 * STREAMED_ROWS * kQkPitch;  // [2][STREAMED_ROWS][kVPitch]
    // PAIRED_WARPS: the slabs' S, then dS, [kSlabs][kPairedScores][32].
    float* exchange = reinterpret_cast<float*>(v_tiles + 2 * STREAMED_ROWS * kVPitch);

    const SequenceTables tables = SEQUENCE_TABLES;
    const QueryBlock owned = query_block(OWNED_ROWS, n_q_total, n_k_total, band_offset,
                                         n_q_heads, group_size, tables);
    const i64 bh = owned.bh, batch = owned.batch, n_q = owned.n_q, n_k = owned.n_k;
    const int head = owned.head, kv_head = owned.kv_head;
    const Band band{owned.band_offset, window_left, window_right};
    const element* k_head = k + batch * k_sb + kv_head * k_sh + owned.key_base * k_sn;
    const element* v_head = v + batch * v_sb + kv_head * v_sh + owned.key_base * v_sn;
    // The sequence's row 0 of this head in dq, lse and D.
    const i64 head_row0 = owned.out_head * n_q_total + owned.row_base;
    static_assert(!(SPLIT_KEYS && VARLEN), "dQ's shares run dense grids only");
    const i64 row_start = owned.row_start;
    const i64 row_stop = min(row_start + OWNED_ROWS, n_q);
    const ScoresOf<accum> scores = make_scores(scale, softcap, alibi_slopes, bh, band,
                                               dropout_key, dropout_threshold, dropout_scale,
                                               dropout_row0, dropout_col0);

    i64 tile_begin, tile_end;
    key_tile_range<LIMIT_LEFT, LIMIT_RIGHT>(band, row_start, row_stop, n_k, STREAMED_ROWS,
                                            &tile_begin, &tile_end);
    split_key_tiles(&tile_begin, &tile_end);
    if (tile_begin == tile_end) {  // no row of this tile keeps any key (in this share): dq = 0
        const auto dq_rows = output_rows<HEAD_DIM>(dq, owned, n_q_total, {dq_sb, dq_sh, dq_sn});
        for (i64 i = threadIdx.x; i < (row_stop - row_start) * HEAD_DIM; i += kThreads)
            dq_rows.row0[(row_start + i / HEAD_DIM) * dq_rows.stride + i % HEAD_DIM] = 0;
        return;
    }

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int quad_row = lane / 4, quad_col = lane % 4;
    // This warp's 16 rows; a pair's first warp computes S and dQ's first kDqColumns
    // columns, its second dP, dS and the other columns (warp-uniform).
    const int slab = warp % kSlabs;
    const bool first_of_pair = !PAIRED_WARPS || warp < kSlabs;
    const int dq_column0 = first_of_pair ? 0 : kDqColumns;
    const i64 my_rows[2] = {row_start + slab * 16 + quad_row,
                            row_start + slab * 16 + quad_row + 8};
    accum row_lse[2], row_delta[2];
    u32 row_states[2];
    load_query_row_terms(scores, lse + head_row0, delta + head_row0, 0, n_q, my_rows, row_lse,
                         row_delta, row_states);

    const auto load_keys = [&](int stage, i64 key_tile) {
        load_tile_async<STREAMED_ROWS, HEAD_DIM, kHeadWidth, kThreads, kQkPitch, COPY_BYTES>(
            k_tiles + stage * STREAMED_ROWS * kQkPitch, k_head, k_sn, key_tile * STREAMED_ROWS,
            n_k);
        load_tile_async<STREAMED_ROWS, VALUE_DIM, kValueWidth, kThreads, kVPitch, COPY_BYTES>(
            v_tiles + stage * STREAMED_ROWS * kVPitch, v_head, v_sn, key_tile * STREAMED_ROWS,
            n_k);
    };
    const auto tile_is_masked = [&](i64 key_tile) {
        const i64 col_start = key_tile * STREAMED_ROWS;
        return col_start + STREAMED_ROWS > n_k ||
               tile_straddles_band(band, row_start, OWNED_ROWS, col_start, STREAMED_ROWS);
    };
    const auto key_tile_mask = [&](i64 key_tile) {
        return tile_mask<LIMIT_LEFT, LIMIT_RIGHT>(band, row_start, key_tile * STREAMED_ROWS, n_k);
    };

    load_tile_async<OWNED_ROWS, HEAD_DIM, kHeadWidth, kThreads, kQkPitch, COPY_BYTES>(
        q_tile, q + batch * q_sb + head * q_sh + owned.row_base * q_sn, q_sn, row_start, n_q);
    load_tile_async<OWNED_ROWS, VALUE_DIM, kValueWidth, kThreads, kVPitch, COPY_BYTES>(
        do_tile, d_out + batch * do_sb + head * do_sh + owned.row_base * do_sn, do_sn,
        row_start, n_q);
    commit_copies();

    // dQ += dS K, dS = P * (dP * dropout - D) * softcap'.
    Accumulators<kDqColumns> dq_acc;
    dq_acc.clear();
    load_keys(0, tile_begin);
    commit_copies();
    stream_tiles(tile_begin, tile_end, load_keys, [&](int stage, i64 key_tile) {
        element* k_tile = k_tiles + stage * STREAMED_ROWS * kQkPitch;
        const element* v_tile = v_tiles + stage * STREAMED_ROWS * kVPitch;
        Accumulators<STREAMED_ROWS> s, dp;
        const bool masked = tile_is_masked(key_tile);
#if PAIRED_WARPS
        // S from the first warp to the second, which turns it into dS, then back.
        if (first_of_pair) {
            one_score_product(q_tile, k_tile, slab * 16, s);
            publish_scores(s, exchange, slab);
        } else {
            value_score_product(do_tile, v_tile, slab * 16, dp);
        }
        __syncthreads();
        if (!first_of_pair) {
            take_scores(s, exchange, slab);
            scores_to_ds(scores, s.tile, dp.tile, row_lse, my_rows, row_states, row_delta,
                         key_tile * STREAMED_ROWS, masked, key_tile_mask(key_tile));
            publish_scores(s, exchange, slab);
        }
        __syncthreads();
        if (first_of_pair) take_scores(s, exchange, slab);
#else
        two_score_products(q_tile, k_tile, do_tile, v_tile, slab * 16, s, dp);
        scores_to_ds(scores, s.tile, dp.tile, row_lse, my_rows, row_states, row_delta,
                     key_tile * STREAMED_ROWS, masked, key_tile_mask(key_tile));
#endif
        // A cut tile (block-uniform) with inf/NaN in K: the kept pairs' dS K terms with it
        // on CUDA cores, then zeros for the tensor cores (kept_products.cuh). The first
        // barrier also orders every warp's S = Q K^T before the zeroing.
        if (kBandMasksKeys && masked &&
            __syncthreads_or(tile_has_non_finite<STREAMED_ROWS, kHeadWidth, kQkPitch,
                                                           kThreads>(k_tile))) {
            const TileMask mask = key_tile_mask(key_tile);
            add_kept_non_finite_values<STREAMED_ROWS / 8>(
                dq_acc.tile,
                [&](int, int half) {
                    return mask.row_window(static_cast<int>(my_rows[half] - mask.row0), 0);
                },
                HeldFromTile<STREAMED_ROWS / 8, accum>{s.tile}, [&](int key, int col) {
                    return dq_column0 + col < kHeadWidth
                               ? element_value(k_tile[key * kQkPitch + dq_column0 + col])
                               : 0.0f;
                });
            __syncthreads();
            zero_non_finite<STREAMED_ROWS, kHeadWidth, kQkPitch, kThreads>(k_tile);
            __syncthreads();
        }
        if (first_of_pair)
            accumulate_columns<kDqColumns, kHeadWidth>(s, k_tile, 0, dq_acc);
        else
            accumulate_columns<kHeadWidth - kDqColumns, kHeadWidth>(s, k_tile, kDqColumns,
                                                                    dq_acc);
    });
    store_rows<HEAD_DIM>(dq_acc, scale,
                         output_rows<HEAD_DIM>(dq, owned, n_q_total, {dq_sb, dq_sh, dq_sn}),
                         row_start + slab * 16, n_q, dq_column0);
}

// ------------------------------------------------------------------ dK, dV

extern "C" __global__ void __launch_bounds__(kThreads) attention_backward_dkdv_mma(
    const element* q, const element* k, const element* v, const element* d_out, const accum* lse,
    const accum* delta, element* dk, element* dv, float* dq_sum, int* dq_turns, int* key_flags,
    const double* alibi_slopes, i64 n_q_total, i64 n_k_total,
    int n_q_heads, int group_size, i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh,
    i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn, i64 do_sb, i64 do_sh, i64 do_sn,
    SCORE_OPTION_PARAMS, SEQUENCE_PARAMETERS, i64 dk_sb, i64 dk_sh, i64 dk_sn, i64 dv_sb,
    i64 dv_sh, i64 dv_sn) {
    static_assert(!(STRIDED_OUT && GROUP_SPLITS > 1), "cut groups write contiguous parts");
    extern __shared__ __align__(16) element shared_tiles[];
    element* k_tile = shared_tiles;                               // [OWNED_ROWS][kQkPitch]
    element* v_tile = k_tile + OWNED_ROWS * kQkPitch;             // [OWNED_ROWS][kVPitch]
    // [2][STREAMED_ROWS][kQkPitch]; the dV-only part holds no V tile.
    element* q_tiles = v_tile + (kComputesDk ? OWNED_ROWS * kVPitch : 0);
    element* do_tiles = q_tiles + 2 * STREAMED_ROWS * kQkPitch;   // [2][STREAMED_ROWS][kVPitch]
    accum* lse_tiles = reinterpret_cast<accum*>(do_tiles + 2 * STREAMED_ROWS * kVPitch);
    accum* delta_tiles = lse_tiles + 2 * STREAMED_ROWS;         // [2][STREAMED_ROWS] each
    // PAIRED_WARPS: the slabs' S^T, [kSlabs][kPairedScores][32].
    float* exchange = reinterpret_cast<float*>(delta_tiles + 2 * STREAMED_ROWS);
#if SINGLE_PASS
    // The current query tile's dS (see kDsPitch).
    ds_element* ds_tile = reinterpret_cast<ds_element*>(
        exchange + (PAIRED_WARPS ? kSlabs * kPairedScores * 32 : 0));
#endif

    const SequenceTables tables = SEQUENCE_TABLES;
    const int n_kv_heads = n_q_heads / group_size;
    // ORDERED: turns need a head's key blocks in ascending order (backward_single_pass.cuh),
    // which the tile-major order keeps; it also starts few blocks of a head together, so
    // few trail each other, and under a causal band the longest first.
#if ORDERED
    const i64 block_index = ordered_block_index(dq_turns);
    int* const turns = dq_turns + 1;
#else
    const i64 block_index = blockIdx.x;
#endif
    const KeyBlock owned = key_block<kBandedGrid || ORDERED>(
        OWNED_ROWS, n_q_total, n_k_total, band_offset, n_kv_heads, tables, block_index);
    const i64 batch = owned.batch, n_q = owned.n_q, n_k = owned.n_k;
    const int kv_head = owned.kv_head;
    const Band band{owned.band_offset, window_left, window_right};
    const i64 col_start = owned.key_start;
    const i64 tile = col_start / OWNED_ROWS;
    const i64 col_stop = min(col_start + OWNED_ROWS, n_k);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int quad_row = lane / 4;
    // This warp's 16 keys and what it computes of them (warp-uniform).
    const int slab = warp % kSlabs;
    const bool computes_dv = PAIRED_WARPS ? warp < kSlabs : kComputesDv;
    const bool computes_dk = PAIRED_WARPS ? warp >= kSlabs : kComputesDk;
    const i64 my_keys[2] = {col_start + slab * 16 + quad_row,
                            col_start + slab * 16 + quad_row + 8};
    const auto dk_head = key_output_rows<HEAD_DIM>(dk, owned, n_k_total, {dk_sb, dk_sh, dk_sn});
    const auto dv_head = key_output_rows<VALUE_DIM>(dv, owned, n_k_total, {dv_sb, dv_sh, dv_sn});

    // The part's accumulators (the other part's are never touched: no registers); a pair's
    // two warps hold dV and dK in the same registers.
#if PAIRED_WARPS
    static_assert(kDkHeld == kDvHeld, "one tile for either half");
    Accumulators<kDkHeld> pair_acc;
    Accumulators<kDkHeld>& dk_acc = pair_acc;
    Accumulators<kDvHeld>& dv_acc = pair_acc;
#else
    Accumulators<kDkHeld> dk_acc;
    Accumulators<kDvHeld> dv_acc;
#endif
    if (computes_dk) dk_acc.clear();
    if (computes_dv) dv_acc.clear();
    i64 tile_begin, tile_end;
    query_tile_range<LIMIT_LEFT, LIMIT_RIGHT>(band, col_start, col_stop, n_q, STREAMED_ROWS,
                                              &tile_begin, &tile_end);
    if (tile_begin == tile_end) {  // no query keeps these keys: dk = dv = 0
        if (computes_dk) store_rows<HEAD_DIM>(dk_acc, 0.0f, dk_head, col_start + slab * 16, n_k);
        if (computes_dv) store_rows<VALUE_DIM>(dv_acc, 0.0f, dv_head, col_start + slab * 16, n_k);
        if (FLAG_NON_FINITE_KEYS && kComputesDk && threadIdx.x == 0) key_flags[block_index] = 0;
        return;
    }

    const int kv_source = kv_head / GROUP_SPLITS;  // the head of k and v
    load_tile_async<OWNED_ROWS, HEAD_DIM, kHeadWidth, kThreads, kQkPitch, COPY_BYTES>(
        k_tile, k + batch * k_sb + kv_source * k_sh + owned.key_base * k_sn, k_sn, col_start,
        n_k);
    if (kComputesDk)
        load_tile_async<OWNED_ROWS, VALUE_DIM, kValueWidth, kThreads, kVPitch, COPY_BYTES>(
            v_tile, v + batch * v_sb + kv_source * v_sh + owned.key_base * v_sn, v_sn, col_start,
            n_k);
    commit_copies();

    for (int member = 0; member < group_size; ++member) {
        const int head = kv_head * group_size + member;
        const i64 bh = owned.index * n_q_heads + head;  // dropout and ALiBi
        const i64 array_head = batch * n_q_heads + head;  // q, dO, lse, D
        const ScoresOf<accum> scores = make_scores(scale, softcap, alibi_slopes, bh, band,
                                                   dropout_key, dropout_threshold, dropout_scale,
                                                   dropout_row0, dropout_col0);
        const element* q_head = q + batch * q_sb + head * q_sh + owned.row_base * q_sn;
        const element* do_head = d_out + batch * do_sb + head * do_sh + owned.row_base * do_sn;
        const i64 head_row0 = array_head * n_q_total + owned.row_base;  // in lse and D
        // The single pass under a band walks its query tiles from the last: the blocks of
        // a head that run together then add to the same dQ rows at once, where an
        // ascending walk (each block from its own first tile) spreads their additions
        // over the whole of dQ (float32 causal: 0-3 % faster in arrival order, NOTES-gpu
        // v40), and in turns they trail each other by a turn, not by tiles.
        constexpr bool kDescending = SINGLE_PASS && (LIMIT_LEFT || LIMIT_RIGHT);
        const auto visited_tile = [&](i64 step) {
            return kDescending ? tile_begin + tile_end - 1 - step : step;
        };
        const auto load_queries = [&](int stage, i64 query_tile) {
            const i64 start = query_tile * STREAMED_ROWS;
            load_tile_async<STREAMED_ROWS, HEAD_DIM, kHeadWidth, kThreads, kQkPitch, COPY_BYTES>(
                q_tiles + stage * STREAMED_ROWS * kQkPitch, q_head, q_sn, start, n_q);
            load_tile_async<STREAMED_ROWS, VALUE_DIM, kValueWidth, kThreads, kVPitch, COPY_BYTES>(
                do_tiles + stage * STREAMED_ROWS * kVPitch, do_head, do_sn, start, n_q);
            for (int i = threadIdx.x; i < 2 * STREAMED_ROWS; i += kThreads) {
                const int r = i % STREAMED_ROWS;
                const bool valid = start + r < n_q;
                const accum* source = (i < STREAMED_ROWS ? lse : delta) + head_row0 +
                                      (valid ? start + r : 0);
                accum* destination = (i < STREAMED_ROWS ? lse_tiles : delta_tiles) +
                                     stage * STREAMED_ROWS + r;
#if IS_FLOAT64
                copy_chunk_async<8>(shared_address(destination), source, valid);
#else
                copy_4_async(shared_address(destination), source, valid);
#endif
            }
        };
        const auto load_queries_in_turn = [&](int stage, i64 step) {
            load_queries(stage, visited_tile(step));
        };
        load_queries(0, visited_tile(tile_begin));
        commit_copies();
        stream_tiles(tile_begin, tile_end, load_queries_in_turn, [&](int stage, i64 step) {
            const i64 query_tile = visited_tile(step);
            element* q_tile = q_tiles + stage * STREAMED_ROWS * kQkPitch;
            element* do_tile = do_tiles + stage * STREAMED_ROWS * kVPitch;
            const accum* lse_tile = lse_tiles + stage * STREAMED_ROWS;
            const accum* delta_tile = delta_tiles + stage * STREAMED_ROWS;
            const i64 query_start = query_tile * STREAMED_ROWS;
            // S^T and dP^T: rows are this warp's keys, columns the tile's queries.
            Accumulators<STREAMED_ROWS> st, dpt;
#if PAIRED_WARPS
            if (computes_dv) {
                one_score_product<true>(k_tile, q_tile, slab * 16, st);
                publish_scores(st, exchange, slab);
                dpt.clear();
            } else {
                value_score_product<true>(v_tile, do_tile, slab * 16, dpt);
            }
            __syncthreads();  // every slab's S^T published
            if (computes_dk) take_scores(st, exchange, slab);
#else
            if (kComputesDk)
                two_score_products<true>(k_tile, q_tile, v_tile, do_tile, slab * 16, st, dpt);
            else
                one_score_product<true>(k_tile, q_tile, slab * 16, st);
#endif
            // Keys past n_k are not written; outside the single pass they need no mask.
            const bool masked =
                tile_straddles_band(band, query_start, STREAMED_ROWS, col_start, OWNED_ROWS);
            transposed_probabilities<STREAMED_ROWS / 8, SINGLE_PASS, QUERY_TAIL>(
                scores, st.tile, dpt.tile, lse_tile, delta_tile, query_start, my_keys, col_start,
                n_q, n_k, masked,
                tile_mask<LIMIT_LEFT, LIMIT_RIGHT>(band, query_start, col_start, n_k));
            // A cut tile (block-uniform) with inf/NaN in dO or Q: the kept pairs' P^T dO and
            // dS^T Q terms with it on CUDA cores, then zeros for the tensor cores
            // (kept_products.cuh); keys are the rows here, queries the inner index. The
            // scans' barriers also order every warp's score products before the zeroing;
            // every warp takes the same barriers (a pair's warps add different terms).
            if (kBandMasksKeys && masked) {
                const TileMask mask =
                    tile_mask<LIMIT_LEFT, LIMIT_RIGHT>(band, query_start, col_start, n_k);
                const auto kept_queries = [&](int, int half) {
                    return mask.column_window(static_cast<int>(my_keys[half] - col_start), 0);
                };
                const bool do_non_finite =
                    kComputesDv && __syncthreads_or(tile_has_non_finite<
                                       STREAMED_ROWS, kValueWidth, kVPitch, kThreads>(do_tile));
                const bool q_non_finite =
                    kComputesDk && __syncthreads_or(tile_has_non_finite<
                                       STREAMED_ROWS, kHeadWidth, kQkPitch, kThreads>(q_tile));
                if (computes_dv && do_non_finite)
                    add_kept_non_finite_values<STREAMED_ROWS / 8>(
                        dv_acc.tile, kept_queries, HeldFromTile<STREAMED_ROWS / 8, accum>{st.tile},
                        [&](int query, int col) {
                            return kDvHeld == kValueWidth || col < kValueWidth
                                       ? element_value(do_tile[query * kVPitch + col])
                                       : 0.0f;
                        });
                if (computes_dk && q_non_finite)
                    add_kept_non_finite_values<STREAMED_ROWS / 8>(
                        dk_acc.tile, kept_queries, HeldFromTile<STREAMED_ROWS / 8, accum>{dpt.tile},
                        [&](int query, int col) {
                            return kDkHeld == kHeadWidth || col < kHeadWidth
                                       ? element_value(q_tile[query * kQkPitch + col])
                                       : 0.0f;
                        });
                if (do_non_finite || q_non_finite) {
                    __syncthreads();
                    if (do_non_finite)
                        zero_non_finite<STREAMED_ROWS, kValueWidth, kVPitch, kThreads>(do_tile);
                    if (q_non_finite)
                        zero_non_finite<STREAMED_ROWS, kHeadWidth, kQkPitch, kThreads>(q_tile);
                    __syncthreads();
                }
            }
            if (computes_dv)
                accumulate_columns<kValueWidth, kValueWidth>(st, do_tile, 0, dv_acc);
#if SINGLE_PASS
            if (computes_dk) store_scores(dpt, ds_tile, slab * 16);
#endif
            if (computes_dk) accumulate_columns<kHeadWidth, kHeadWidth>(dpt, q_tile, 0, dk_acc);
#if SINGLE_PASS
            {
                // Every dK warp's dS rows are in ds_tile. On a cut tile the barrier also ORs
                // a scan of the owned K tile for inf or NaN (add_query_tile_dq).
                const bool k_non_finite =
                    kBandMasksKeys
                        ? __syncthreads_or(
                              masked && tile_has_non_finite<OWNED_ROWS, kHeadWidth, kQkPitch,
                                                            kThreads>(k_tile))
                        : (__syncthreads(), false);
                const TileMask mask =
                    tile_mask<LIMIT_LEFT, LIMIT_RIGHT>(band, query_start, col_start, n_k);
                // DQ_PARTS: this key block's slot of the head's parts.
                const i64 key_tiles = (n_k + OWNED_ROWS - 1) / OWNED_ROWS;
                float* const dq_head =
                    dq_sum + (DQ_PARTS ? array_head * key_tiles + tile : array_head) * n_q *
                                 HEAD_DIM;
#if ORDERED
                const i64 n_q_tiles = (n_q + STREAMED_ROWS - 1) / STREAMED_ROWS;
                add_query_tile_dq_in_turn(ds_tile, k_tile, dq_head, query_start, n_q,
                                          k_non_finite, mask,
                                          turns + array_head * n_q_tiles + query_tile,
                                          dq_turn_rank(band, query_tile, tile, n_q, n_k));
#else
                add_query_tile_dq(ds_tile, k_tile, dq_head, query_start, n_q, k_non_finite,
                                  mask);
#endif
            }
#endif
        });
    }
    if (computes_dk) store_rows<HEAD_DIM>(dk_acc, scale, dk_head, col_start + slab * 16, n_k);
    if (computes_dv) store_rows<VALUE_DIM>(dv_acc, 1.0f, dv_head, col_start + slab * 16, n_k);
    // The owned tiles are still in shared memory (zeros past n_k and past the head dims).
    if (FLAG_NON_FINITE_KEYS && kComputesDk)
        flag_non_finite_keys(
            key_flags,
            tile_has_non_finite<OWNED_ROWS, kHeadWidth, kQkPitch, kThreads>(k_tile) ||
                tile_has_non_finite<OWNED_ROWS, kValueWidth, kVPitch, kThreads>(v_tile),
            block_index);
}
