// The launch's shards, parameters and the end of a column block, shared by the linear kernels' units (linear.cu:
// the split-K kernel and the input transform; tc.cu: the tensor-core kernel).

#pragma once

#include "common.cuh"

namespace qp {

constexpr int MAX_SHARDS = 8;  // shards one launch runs

// One shard of a launch: its tensors and where its columns go.
struct Shard {
    const uint8_t* trellis;  // (k/16, n/16, tile bytes)
    const __half* suh;       // (k,)
    const __half* svh;       // (n,)
    int n;                   // stored output features (a multiple of 128)
    int col;                 // first output column it writes
    int out_features;        // columns it writes (<= n)
    int block0;              // its first column block in the launch's grid
};

struct Params {
    const void* x;   // (rows, x_width) activations, fp16 or bf16, row stride x_stride elements
    const void* xh;  // (shards, rows, k) fp16 had128(x * suh) of each shard, row stride k (non-fused kernels only)
    void* out;       // (rows, *) model dtype, row stride out_stride
    float* partials;  // split-K partial sums: (chunks, splits, mrows, n), n = the shards' stored columns in order
    int* counters;    // (chunks, n / 128) arrival counters, zero between launches
    Shard shard[MAX_SHARDS];
    int shards;
    int rows, x_width, x_stride, k, n, out_stride;
    int slice_tiles;  // k tiles per split (a multiple of 8)
    int splits;
    int mrows;  // rows per chunk in the partials (min(rows, 16 * MB))
    int bf16;   // x and out are bf16 (else fp16)
};

// x * suh of one row's 128-column block (lane holds 4 values), zero beyond x_width.
__device__ __forceinline__ void input_load(const Params& p, const __half* suh, int row, int kc, int lane,
                                           float (&v)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = kc + lane * 4 + i;
        v[i] = c < p.x_width ? load_act(p.x, (size_t)row * p.x_stride + c, p.bf16) * __half2float(suh[c]) : 0.0f;
    }
}

// A field of shard i of the launch's table, by unrolled selects (no local-memory copy of the table).
template <class V>
__device__ __forceinline__ V field(const Params& p, int i, V Shard::*member) {
    V v = p.shard[0].*member;
#pragma unroll
    for (int j = 1; j < MAX_SHARDS; ++j)
        if (j == i) v = p.shard[j].*member;
    return v;
}

// The shard of column block nb of a launch (its index in the launch's table).
__device__ __forceinline__ int shard_of(const Params& p, int nb) {
    int si = 0;
#pragma unroll
    for (int i = 1; i < MAX_SHARDS; ++i)
        if (i < p.shards && nb >= p.shard[i].block0) si = i;
    return si;
}

// The end of a column block once F (row-major, F_STRIDE floats a row) holds this CTA's sums of `rows` rows (of the
// chunk whose first row is row0) for its 128 columns: with a split of k (p.splits > 1) this CTA's partial goes to the
// workspace and the block's last CTA (an arrival counter) sums the splits' partials in split order into F, so
// results are deterministic and a CUDA-graph replay is bit-identical to an eager call; then the CTA holding the full
// sums applies the output Hadamard transform and svh and writes the shard's columns of the output in the model
// dtype. Returns early where another CTA finishes the block.
__device__ __forceinline__ void finish_block(const Params& p, float* F, int& last_arrival, int si, int nb, int lnb,
                                             int chunk, int split, int row0, int rows) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (p.splits > 1) {
        // partials and their sum move as float4 (a row's 128 columns are 32 of them; rows start 16-byte aligned in
        // the workspace, n being a multiple of 128, and in F, F_STRIDE a multiple of 4): (chunk, split, mrows, n)
        const size_t n0 = (size_t)nb * BLOCK_N;
        const size_t stride = p.n;
        float* mine = p.partials + ((size_t)(chunk * p.splits + split) * p.mrows) * p.n + n0;
        for (int e = threadIdx.x * 4; e < rows * BLOCK_N; e += THREADS * 4)
            *reinterpret_cast<float4*>(mine + (size_t)(e / BLOCK_N) * stride + e % BLOCK_N) =
                *reinterpret_cast<const float4*>(F + (e / BLOCK_N) * F_STRIDE + e % BLOCK_N);
        __threadfence();
        __syncthreads();
        int* counter = p.counters + (size_t)chunk * (p.n / BLOCK_N) + nb;
        if (threadIdx.x == 0) last_arrival = atomicAdd(counter, 1) == p.splits - 1;
        __syncthreads();
        if (!last_arrival) return;
        __threadfence();
        const float* all = p.partials + ((size_t)chunk * p.splits * p.mrows) * p.n + n0;
        for (int e = threadIdx.x * 4; e < rows * BLOCK_N; e += THREADS * 4) {
            const size_t at = (size_t)(e / BLOCK_N) * p.n + e % BLOCK_N;
            float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // summed in split order: deterministic
#pragma unroll 8
            for (int sp = 0; sp < p.splits; ++sp) {
                const float4 v = __ldcg(reinterpret_cast<const float4*>(all + (size_t)sp * p.mrows * p.n + at));
                s.x += v.x;
                s.y += v.y;
                s.z += v.z;
                s.w += v.w;
            }
            *reinterpret_cast<float4*>(F + (e / BLOCK_N) * F_STRIDE + e % BLOCK_N) = s;
        }
        if (threadIdx.x == 0) *counter = 0;
        __syncthreads();
    }

    // the output Hadamard transform, svh, the shard's columns of the output
    const __half* svh = field(p, si, &Shard::svh);
    const int shard_col = field(p, si, &Shard::col), shard_out = field(p, si, &Shard::out_features);
    for (int m = warp; m < rows; m += WARPS) {
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = F[m * F_STRIDE + lane * 4 + i];
        fwht128(v, lane);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int c = lnb * BLOCK_N + lane * 4 + i;
            if (c < shard_out)
                store_act(p.out, (size_t)(row0 + m) * p.out_stride + shard_col + c,
                          v[i] * HAD_SCALE * __half2float(svh[c]), p.bf16);
        }
    }
}

// The launch's table of shards (n_total: their stored columns). Returns 0 or -1 (bad geometry).
inline int fill_shards(Params& p, const void* const* trellis, const void* const* suh, const void* const* svh,
                       const int* n, const int* col, const int* out_features, int shards, int& n_total) {
    n_total = 0;
    for (int i = 0; i < shards; ++i) {
        if (n[i] % 128 || n[i] <= 0 || out_features[i] > n[i]) return -1;
        p.shard[i] = Shard{static_cast<const uint8_t*>(trellis[i]), static_cast<const __half*>(suh[i]),
                           static_cast<const __half*>(svh[i]), n[i], col[i], out_features[i], n_total / BLOCK_N};
        n_total += n[i];
    }
    return 0;
}

// How many CTAs split k in a launch of `rows` rows in chunks of chunk_rows over n columns (the shards' stored columns):
// as many splits as keep the grid within target_ctas CTAs (one wave: a grid just above it, e.g. 560 CTAs for 528
// slots, would run a second wave of a few CTAs that the whole call waits for), at most max_splits, whole 128-column
// blocks of k per split, and the partials (chunks x splits x rows x n floats) and counters within the workspace.
inline int split_count(int rows, int chunk_rows, int k, int n, int target_ctas, int max_splits, long long partial_floats,
                       long long counters) {
    const int chunks = (rows + chunk_rows - 1) / chunk_rows;
    const int ktiles = k / 16, nbk = n / BLOCK_N;
    const int mrows = rows < chunk_rows ? rows : chunk_rows;
    const long long ctas = (long long)nbk * chunks;
    int splits = (int)(target_ctas / ctas);
    if (splits > ktiles / 8) splits = ktiles / 8;
    if (splits > max_splits) splits = max_splits;
    if (splits < 1) splits = 1;
    // equal slices of whole 128-column blocks, then no more splits than slices
    int slice = (ktiles / 8 + splits - 1) / splits * 8;
    splits = (ktiles + slice - 1) / slice;
    while (splits > 1 && ((long long)chunks * splits * mrows * n > partial_floats || ctas > counters)) {
        splits = splits / 2;
        slice = (ktiles / 8 + splits - 1) / splits * 8;
        splits = (ktiles + slice - 1) / slice;
    }
    return splits;
}

// had128(x * suh) / sqrt(128) of every row of each of the launch's shards into p.xh (linear.cu's transform kernel).
// Returns 0 or a CUDA error code.
int launch_input_transform(const Params& p, cudaStream_t s);

}  // namespace qp
