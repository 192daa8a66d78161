// What the expert kernels share (moe.cu: the sort, the 16-row mma.sync kernel, the reduction; moe_tc.cu: the
// tensor-core path on Hopper): the launch parameters, the sort's plan of work items, the input rows of each
// projection and the end of a CTA (output transform, svh, the rows of gu or y). moe.cu's head describes the launches.

#pragma once

#include "common.cuh"

namespace qp {

constexpr int MOE_ROWS = 16;          // rows per work item (one mma fragment)
constexpr int MOE_MAX_GROUPS = 16;    // K groups one bank may have
constexpr int MOE_SORT_THREADS = 1024;

struct MoeParams {
    const void* x;                 // (tokens, x_width) model dtype, row stride x_stride (gate/up)
    __half* gu;                    // (slots, 2 * inter) fp16 (ungated: (slots, inter)): gate/up writes, down reads
    float* y;                      // (slots, hidden) fp32: down writes its weighted rows at the pick's index
    const long long* tables;       // (9, E) device pointers: w1, w3, w2 x (trellis, suh, svh) per slot
    const int* sorted;             // (slots,) pick indices in slot order
    const int* offsets;            // (E + 1,) first sorted position of each slot
    const int* work;               // (2 * items,) (slot, first row) per work item
    const int* group_work;         // (groups + 1,) first work item of each K group
    const void* weights;           // (slots,) routing weights: fp32, fp16 or bf16 (weights_dtype 0 / 1 / 2)
    float* partials;               // split-K partials: (grid z, splits, rows of an item, n)
    int* counters;                 // (grid z, n / 128), zero between launches
    int E, top_k;
    int groups;                    // K groups of the bank
    int group_k2[MOE_MAX_GROUPS];  // 2K of each group
    int x_width, x_stride, bf16, weights_dtype;
    int k;      // reduction width: stored hidden (gate/up) or stored intermediate (down)
    int n_proj; // stored output columns of one projection: intermediate (gate/up) or hidden (down)
    int n;      // the grid's columns: 2 * intermediate (ungated: intermediate) or hidden
    int gated;  // 1: down(silu(x W1) * (x W3)); 0: ungated down(relu(x W1)^2), no W3 (Nemotron-H's experts)
    int slice_tiles, splits;
    // the tensor-core path (moe_tc.cu): each pick's slot (the sort's slot_of) for the transform launch, and the
    // transformed input rows in sorted order, plane i (gate/up: w1, w3) at xh + i * xh_plane * k
    const int* slot_of;
    __half* xh;
    int xh_plane;
};

__device__ __forceinline__ float load_weight(const void* w, int i, int dtype) {
    if (dtype == 0) return static_cast<const float*>(w)[i];
    if (dtype == 1) return __half2float(static_cast<const __half*>(w)[i]);
    return __bfloat162float(static_cast<const __nv_bfloat16*>(w)[i]);
}

// The work items of slots lo .. hi - 1 given their pick counts, each slot's picks cut into items of up to
// `item_rows` rows (16: the mma.sync kernel; 64: the tensor-core path), numbered from `item`; offsets of their
// sorted picks from `pos`. Host and device (the sort kernel's one serial step), so a test checks the plan on the CPU.
__host__ __device__ inline void moe_plan_groups(const int* counts, int E, const int* group_lo, int groups,
                                                int* offsets, int* group_work, int* item_base, int item_rows) {
    int pos = 0, item = 0;
    for (int g = 0; g < groups; ++g) {
        group_work[g] = item;
        const int lo = group_lo[g], hi = g + 1 < groups ? group_lo[g + 1] : E;
        for (int s = lo; s < hi; ++s) {
            offsets[s] = pos;
            item_base[s] = item;
            pos += counts[s];
            item += (counts[s] + item_rows - 1) / item_rows;
        }
    }
    offsets[E] = pos;
    group_work[groups] = item;
}

// One value of an expert GEMM's input row before the Hadamard transform: gate/up (DOWN false) reads the pick's token
// row of x, down reads silu(gate) * up of the pick from gu (ungated experts: relu(gate)^2); both times the
// projection's suh.
template <bool DOWN>
__device__ __forceinline__ float moe_input(const MoeParams& p, int pick_or_pos, int c, float suh) {
    if constexpr (DOWN) {
        const size_t row = (size_t)pick_or_pos * (p.gated ? 2 : 1) * p.k;
        const float g = __half2float(p.gu[row + c]);
        if (!p.gated) {
            const float r = fmaxf(g, 0.0f);
            return r * r * suh;
        }
        const float u = __half2float(p.gu[row + p.k + c]);
        return g / (1.0f + __expf(-g)) * u * suh;
    } else {
        const int token = pick_or_pos / p.top_k;
        return c < p.x_width ? load_act(p.x, (size_t)token * p.x_stride + c, p.bf16) * suh : 0.0f;
    }
}

// The end of an expert CTA whose `rows` rows (of an item of `item_rows`) of 128-column sums are in F (row stride
// F_STRIDE): with k splits the partials go to p.partials as (grid z, split, item_rows, n) and the column block's last
// CTA sums them in split order; then the output Hadamard transform and projection `proj`'s svh, written as fp16 to
// the picks' rows of gu (gate/up, sorted positions base ..) or, times the routing weight, as fp32 to the picks'
// rows of y (down). Both expert kernels (moe.cu, moe_tc.cu) end here.
template <bool DOWN>
__device__ __forceinline__ void moe_finish(const MoeParams& p, float* F, int& last_arrival, int item_rows, int rows,
                                           int proj, int lnb, int slot, int base) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int nb = blockIdx.x, split = blockIdx.y, z = blockIdx.z;
    if (p.splits > 1) {
        const size_t n0 = (size_t)nb * BLOCK_N;
        float* mine = p.partials + ((size_t)(z * p.splits + split) * item_rows) * p.n + n0;
        for (int e = threadIdx.x * 4; e < rows * BLOCK_N; e += THREADS * 4)
            *reinterpret_cast<float4*>(mine + (size_t)(e / BLOCK_N) * p.n + e % BLOCK_N) =
                *reinterpret_cast<const float4*>(F + (e / BLOCK_N) * F_STRIDE + e % BLOCK_N);
        __threadfence();
        __syncthreads();
        int* counter = p.counters + (size_t)z * gridDim.x + nb;
        if (threadIdx.x == 0) last_arrival = atomicAdd(counter, 1) == p.splits - 1;
        __syncthreads();
        if (!last_arrival) return;
        __threadfence();
        const float* all = p.partials + ((size_t)z * p.splits * item_rows) * p.n + n0;
        for (int e = threadIdx.x * 4; e < rows * BLOCK_N; e += THREADS * 4) {
            const size_t at = (size_t)(e / BLOCK_N) * p.n + e % BLOCK_N;
            float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int sp = 0; sp < p.splits; ++sp) {
                const float4 v = __ldcg(reinterpret_cast<const float4*>(all + (size_t)sp * item_rows * p.n + at));
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

    const __half* svh = reinterpret_cast<const __half*>(p.tables[(3 * proj + 2) * p.E + slot]);
    for (int m = warp; m < rows; m += WARPS) {
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = F[m * F_STRIDE + lane * 4 + i];
        fwht128(v, lane);
        const int c0 = lnb * BLOCK_N + lane * 4;
        if constexpr (DOWN) {
            const int pick = p.sorted[base + m];
            const float wt = load_weight(p.weights, pick, p.weights_dtype);
            float4 o;
            o.x = v[0] * HAD_SCALE * __half2float(svh[c0]) * wt;
            o.y = v[1] * HAD_SCALE * __half2float(svh[c0 + 1]) * wt;
            o.z = v[2] * HAD_SCALE * __half2float(svh[c0 + 2]) * wt;
            o.w = v[3] * HAD_SCALE * __half2float(svh[c0 + 3]) * wt;
            *reinterpret_cast<float4*>(p.y + (size_t)pick * p.n + c0) = o;
        } else {
            __half2* dst = reinterpret_cast<__half2*>(p.gu + (size_t)(base + m) * p.n + proj * p.n_proj + c0);
            dst[0] = __floats2half2_rn(v[0] * HAD_SCALE * __half2float(svh[c0]), v[1] * HAD_SCALE * __half2float(svh[c0 + 1]));
            dst[1] = __floats2half2_rn(v[2] * HAD_SCALE * __half2float(svh[c0 + 2]), v[3] * HAD_SCALE * __half2float(svh[c0 + 3]));
        }
    }
}


// Work items of up to `item_rows` rows that `group_slots` slots can have for `slots` picks at most.
__host__ __device__ inline int moe_items(int slots, int group_slots, int item_rows) {
    return (group_slots < slots ? group_slots : slots) + (slots + item_rows - 1) / item_rows;
}

// k splits of one expert launch of `items` work items of `item_rows` rows: as many as keep items x (n / 128) x splits
// within target_ctas (whole 128-column blocks of k per split), at most TAIL_ROWS partial rows summed by a column
// block's last CTA, within the workspace's partials and counters.
inline int moe_splits(int items, int item_rows, int k, int n, int target_ctas, long long partial_floats,
                      long long counters) {
    const int ktiles = k / 16, nbk = n / BLOCK_N;
    const long long ctas = (long long)nbk * items;
    int splits = (int)(target_ctas / (ctas > 0 ? ctas : 1));
    if (splits > ktiles / 8) splits = ktiles / 8;
    if (splits > TAIL_ROWS / item_rows) splits = TAIL_ROWS / item_rows;
    if (splits < 1) splits = 1;
    int slice = (ktiles / 8 + splits - 1) / splits * 8;
    splits = (ktiles + slice - 1) / slice;
    while (splits > 1 && ((long long)items * splits * item_rows * n > partial_floats || ctas > counters)) {
        splits /= 2;
        slice = (ktiles / 8 + splits - 1) / splits * 8;
        splits = (ktiles + slice - 1) / slice;
    }
    return splits;
}

// The parameters every expert launch shares, checked. Returns 0 or -1 (bad geometry).
inline int moe_params(MoeParams& p, int down, int gated, const void* x, void* gu, float* y, const long long* tables,
                      int E,
                      const int* sorted, const int* offsets, const int* work, const int* group_work,
                      const void* weights, int weights_dtype, float* partials, int* counters, int items, int top_k,
                      int x_width, int x_stride, int k, int n_proj, int bf16) {
    if (k % 128 || k <= 0 || n_proj % 128 || n_proj <= 0 || (!down && x_width > k) || top_k < 1) return -1;
    if (items > 65535) return -1;  // the grid's z limit
    p = MoeParams{};
    p.x = x;
    p.gu = static_cast<__half*>(gu);
    p.y = y;
    p.tables = tables;
    p.sorted = sorted;
    p.offsets = offsets;
    p.work = work;
    p.group_work = group_work;
    p.weights = weights;
    p.partials = partials;
    p.counters = counters;
    p.E = E;
    p.top_k = top_k;
    p.x_width = x_width;
    p.x_stride = x_stride;
    p.bf16 = bf16;
    p.weights_dtype = weights_dtype;
    p.k = k;
    p.n_proj = n_proj;
    p.gated = gated ? 1 : 0;
    p.n = down ? n_proj : (p.gated ? 2 : 1) * n_proj;
    return 0;
}

// The split plan of a launch of `items` work items of `item_rows` rows whose kernel fits `fit` CTAs per SM. Returns 0, a CUDA error
// code or -4 (workspace too small).
inline int moe_plan(MoeParams& p, int fit, int items, int item_rows, int target_ctas, long long partial_floats,
                    long long counters_len) {
    int sms = 0, device = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
        return (int)cudaGetLastError();
    if ((long long)fit * sms < target_ctas) target_ctas = fit * sms;
    p.splits = moe_splits(items, item_rows, p.k, p.n, target_ctas, partial_floats, counters_len);
    const int ktiles = p.k / 16;
    p.slice_tiles = (ktiles / 8 + p.splits - 1) / p.splits * 8;  // a multiple of 8 tiles (TileStream::panel())
    if (p.splits > 1 && ((long long)items * p.splits * item_rows * p.n > partial_floats ||
                         (long long)items * (p.n / BLOCK_N) > counters_len))
        return -4;
    return 0;
}

// Calls f(ka, half) (std::integral_constant / bool_constant) with the K of work item w's group: the group found
// from group_work (a bank's items are numbered in slot order, so a group's are contiguous), its 2K from p.group_k2;
// integer K 1..8, and 1.5 / 2.5 / 3.5 for mul1 (the host refuses the others). The expert kernels' one switch over K,
// so one launch runs every K group.
template <int CB, class F>
__device__ __forceinline__ void moe_group_k(const MoeParams& p, int w, F&& f) {
    using std::bool_constant, std::integral_constant;
    int g = 0;
#pragma unroll
    for (int i = 1; i < MOE_MAX_GROUPS; ++i)
        if (i < p.groups && w >= p.group_work[i]) g = i;
    switch (p.group_k2[g]) {
        case 2: f(integral_constant<int, 1>{}, bool_constant<false>{}); break;
        case 4: f(integral_constant<int, 2>{}, bool_constant<false>{}); break;
        case 6: f(integral_constant<int, 3>{}, bool_constant<false>{}); break;
        case 8: f(integral_constant<int, 4>{}, bool_constant<false>{}); break;
        case 10: f(integral_constant<int, 5>{}, bool_constant<false>{}); break;
        case 12: f(integral_constant<int, 6>{}, bool_constant<false>{}); break;
        case 14: f(integral_constant<int, 7>{}, bool_constant<false>{}); break;
        case 16: f(integral_constant<int, 8>{}, bool_constant<false>{}); break;
        default:
            if constexpr (CB == CB_MUL1) {
                switch (p.group_k2[g]) {
                    case 3: f(integral_constant<int, 1>{}, bool_constant<true>{}); break;
                    case 5: f(integral_constant<int, 2>{}, bool_constant<true>{}); break;
                    case 7: f(integral_constant<int, 3>{}, bool_constant<true>{}); break;
                    default: break;
                }
            }
            break;
    }
}

}  // namespace qp
