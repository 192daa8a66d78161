// Expert banks (docs/moe-bank.md): one MoE layer's routed experts in four kinds of launch per call, each expert's
// trellis read once per 16 of its routed tokens, graph-safe (every size below depends on the token count only). On
// Hopper, calls of many tokens take the tensor-core path instead (moe_tc.cu: the same sort with 64-row items, then a
// transform and a wgmma launch per projection, and the same reduce).
//
//   sort      one CTA: each pick (token t, choice j; pick index t * top_k + j) gets its expert's physical slot
//             (perm; -1 for an expert another tensor-parallel rank holds). Picks are counted per slot and bucketed in
//             slot order (`sorted`, slot s's picks at offsets[s] .. offsets[s + 1]), and every slot's picks are cut
//             into work items of up to 16 rows (slot, first row), numbered in slot order, so the items of one K group
//             (a contiguous slot range) are contiguous: group g owns items group_work[g] .. group_work[g + 1].
//   gate/up   one launch for every K group: a CTA per (128-column block of gate or up, k split, work item), running
//             the K of the item's group (a switch over the K the kernel is built for); the item's rows are its
//             picks' token rows of x, transformed with that projection's suh inside the CTA; the output Hadamard
//             transform and svh as in the dense kernel, written in fp16 to the pick's row of `gu` (sorted position,
//             gate in columns 0 .. I, up in I .. 2I).
//   down      one launch for every K group: a CTA per (128-column block of the hidden side, k split, work item),
//             each at its group's K; the input rows are
//             silu(gate) * up of its picks, read from `gu` and multiplied with down's suh before the transform; the
//             output, times the pick's routing weight, goes to the pick's row of `y` (fp32).
//   reduce    out[t] = sum over the token's picks held here of y[pick], in choice order (deterministic).
//
// A grid's z extent is an upper bound of the bank's work items for the call's token count, the same whatever the
// number of K groups (so a mixed-K bank launches the grid of a uniform one); CTAs past the actual count return at
// once. Rows of one work item are independent in the mma, and split-K partials are summed in
// split order, so results do not depend on the order in which the sort kernel bucketed the picks.

#include "moe.cuh"

namespace qp {

struct MoeSort {
    const void* ids;        // (slots,) logical expert ids, int32 or int64 (ids64)
    const long long* perm;  // (E + 1,) expert id -> slot, last entry -1 (id -1 reads it)
    int ids64, slots, E;
    int item_rows;  // rows per work item
    int groups;
    int group_lo[MOE_MAX_GROUPS];
    int* slot_of;     // (slots,) each pick's slot, -1 when another rank holds its expert
    int* offsets;     // (E + 1,)
    int* sorted;      // (slots,)
    int* work;        // (2 * items,)
    int* group_work;  // (groups + 1,)
};

// One CTA; dynamic shared memory: counts, cursors and item bases of E slots, E + 1 offsets.
__global__ void __launch_bounds__(MOE_SORT_THREADS) moe_sort_kernel(const MoeSort r) {
    extern __shared__ int sm[];
    int* counts = sm;
    int* cursor = sm + r.E;
    int* item_base = sm + 2 * r.E;
    int* offsets = sm + 3 * r.E;  // E + 1
    for (int s = threadIdx.x; s < r.E; s += blockDim.x) counts[s] = cursor[s] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < r.slots; i += blockDim.x) {
        const long long id = r.ids64 ? static_cast<const long long*>(r.ids)[i] : static_cast<const int*>(r.ids)[i];
        const int s = id < 0 || id >= r.E ? -1 : (int)r.perm[id];  // -1: another rank's expert (never out of range)
        r.slot_of[i] = s;
        if (s >= 0) atomicAdd(&counts[s], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) moe_plan_groups(counts, r.E, r.group_lo, r.groups, offsets, r.group_work, item_base, r.item_rows);
    __syncthreads();
    for (int s = threadIdx.x; s <= r.E; s += blockDim.x) r.offsets[s] = offsets[s];
    for (int s = threadIdx.x; s < r.E; s += blockDim.x)
        for (int row = 0; row < counts[s]; row += r.item_rows) {
            const int item = item_base[s] + row / r.item_rows;
            r.work[2 * item] = s;
            r.work[2 * item + 1] = row;
        }
    for (int i = threadIdx.x; i < r.slots; i += blockDim.x) {
        const int s = r.slot_of[i];
        if (s >= 0) r.sorted[offsets[s] + atomicAdd(&cursor[s], 1)] = i;
    }
}

}  // namespace qp

namespace qp {

// Dynamic shared memory of an expert CTA (moe_cta): its 16-row A panel of 64 k tiles (or, after it, the 16 rows of
// 128-column partial sums) and the warps' trellis rings. Its own function: the linear kernels' one-row panel
// (smem_bytes<..., FUSED = true>) is smaller than the expert kernel's 16 rows.
template <int KA, bool HALFK>
__host__ __device__ constexpr int moe_smem_bytes() {
    constexpr int A_BYTES = MOE_ROWS * (64 * 16 + 8) * 2;
    constexpr int F_BYTES = MOE_ROWS * F_STRIDE * 4;
    return (A_BYTES > F_BYTES ? A_BYTES : F_BYTES) + WARPS * GROUPS_IN_FLIGHT * GROUP * Tile<KA, HALFK>::BYTES;
}

// One CTA of an expert launch: 128 output columns (blockIdx.x) x one k slice (blockIdx.y) of work item w, whose
// split-K partials and arrival counter sit at grid index blockIdx.z. `smem` is the launch's dynamic shared memory
// (moe_smem_bytes<KA, HALFK>() at least); `row_pick` and `last_arrival` live in the CTA's static shared memory.
template <int CB, int KA, bool HALFK, bool DOWN>
__device__ __forceinline__ void moe_cta(const MoeParams& p, int w, uint8_t* smem, int* row_pick, int& last_arrival) {
    using T = Tile<KA, HALFK>;
    constexpr int PANEL = 64;
    static_assert(PANEL % (GROUPS_IN_FLIGHT * GROUP) == 0, "TileStream::panel() needs panels of whole ring rounds");
    constexpr int A_STRIDE = PANEL * 16 + 8;
    constexpr int A_BYTES = MOE_ROWS * A_STRIDE * 2;
    constexpr int F_BYTES = MOE_ROWS * F_STRIDE * 4;
    constexpr int AF_BYTES = A_BYTES > F_BYTES ? A_BYTES : F_BYTES;
    static_assert(AF_BYTES + WARPS * GROUPS_IN_FLIGHT * GROUP * T::BYTES == moe_smem_bytes<KA, HALFK>(),
                  "moe_smem_bytes() sizes this CTA's shared memory");

    __half* A = reinterpret_cast<__half*>(smem);
    float* F = reinterpret_cast<float*>(smem);
    uint32_t* ring = reinterpret_cast<uint32_t*>(smem + AF_BYTES);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int nb = blockIdx.x, split = blockIdx.y;
    const int slot = p.work[2 * w], r0 = p.work[2 * w + 1];
    const int base = p.offsets[slot] + r0;
    const int rows = min(p.offsets[slot + 1] - base, MOE_ROWS);
    if (threadIdx.x < MOE_ROWS) row_pick[threadIdx.x] = threadIdx.x < rows ? (DOWN ? base + threadIdx.x : p.sorted[base + threadIdx.x]) : 0;

    // the projection: gate/up's first n_proj / 128 column blocks are gate (w1), the rest up (w3; none when ungated);
    // down is w2
    const int blocks_proj = p.n_proj / BLOCK_N;
    const int proj = DOWN ? 2 : nb / blocks_proj;
    const int lnb = DOWN ? nb : nb % blocks_proj;
    const uint8_t* trellis = reinterpret_cast<const uint8_t*>(p.tables[(3 * proj + 0) * p.E + slot]);
    const __half* suh = reinterpret_cast<const __half*>(p.tables[(3 * proj + 1) * p.E + slot]);
    const int ntiles_n = p.n_proj / 16;
    const int kt0 = split * p.slice_tiles;
    const int ktiles = min(p.slice_tiles, p.k / 16 - kt0);

    const int tn = lnb * (BLOCK_N / 16) + warp;
    const size_t tile_stride = (size_t)ntiles_n * T::BYTES;
    TileStream<CB, KA, HALFK> stream(ring + warp * GROUPS_IN_FLIGHT * TileStream<CB, KA, HALFK>::GROUP_WORDS,
                                     trellis + ((size_t)kt0 * ntiles_n + tn) * T::BYTES, tile_stride, ktiles, lane);
    const __half* a_lane = A + (lane % 16) * A_STRIDE + (lane / 16) * 8;
    float acc[1][2][4] = {};

    for (int p0 = 0; p0 < ktiles; p0 += PANEL) {
        const int ptiles = min(PANEL, ktiles - p0);
        __syncthreads();  // also publishes row_pick before the first panel
        const int kc0 = (kt0 + p0) * 16;
        // the panel: the item's rows x blocks items of 128 columns, one warp per item; the fragment's rows beyond
        // them are left as they are (an mma output row depends on its own A row only, and those rows' sums are never
        // stored)
        const int blocks = ptiles / 8, items = rows * blocks;
        for (int item = warp; item < items; item += WARPS) {
            const int m = item / blocks, kc = kc0 + item % blocks * 128;
            float v[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int c = kc + lane * 4 + i;
                v[i] = moe_input<DOWN>(p, row_pick[m], c, __half2float(suh[c]));
            }
            input_transform(v, lane);
            __half2* dst = reinterpret_cast<__half2*>(A + m * A_STRIDE + item % blocks * 128 + lane * 4);
            dst[0] = __floats2half2_rn(v[0], v[1]);
            dst[1] = __floats2half2_rn(v[2], v[3]);
        }
        __syncthreads();

        stream.template panel<1, A_STRIDE>(a_lane, ptiles, acc);
    }
    cp_async_wait<0>();

    __syncthreads();
    {
        const int g = lane / 4, c = warp * 16 + 2 * (lane % 4);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            F[g * F_STRIDE + c + h * 8] = acc[0][h][0];
            F[g * F_STRIDE + c + h * 8 + 1] = acc[0][h][1];
            F[(g + 8) * F_STRIDE + c + h * 8] = acc[0][h][2];
            F[(g + 8) * F_STRIDE + c + h * 8 + 1] = acc[0][h][3];
        }
    }
    __syncthreads();

    moe_finish<DOWN>(p, F, last_arrival, MOE_ROWS, rows, proj, lnb, slot, base);
}

// Every K group of a bank in one launch: grid z runs over all the call's work items, which are numbered in slot
// order, so a group's items are contiguous; each CTA finds its item's group from group_work and runs that group's K
// (p.group_k2). The grid is the one a bank of one group would have, however the picks fall over the groups.
template <int CB, bool DOWN>
__global__ void __launch_bounds__(THREADS) trellis_moe_kernel(const MoeParams p) {
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ int last_arrival;
    __shared__ int row_pick[MOE_ROWS];
    const int w = blockIdx.z;
    if (w >= p.group_work[p.groups]) return;
    moe_group_k<CB>(p, w, [&](auto ka, auto half) {
        moe_cta<CB, decltype(ka)::value, decltype(half)::value, DOWN>(p, w, smem, row_pick, last_arrival);
    });
}

// out[t, c] = sum over the token's picks j held here (slot_of >= 0) of y[t * top_k + j, c], for c < hidden.
__global__ void moe_reduce_kernel(const float* y, const int* slot_of, void* out, int tokens, int top_k, int hidden_stored,
                                  int hidden, int out_stride, int bf16) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)tokens * hidden) return;
    const int t = i / hidden, c = i % hidden;
    float s = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        const int pick = t * top_k + j;
        if (slot_of[pick] >= 0) s += y[(size_t)pick * hidden_stored + c];
    }
    store_act(out, (size_t)t * out_stride + c, s, bf16);
}


}  // namespace qp

// Work items a K group of `group_slots` slots can have for `slots` picks at most, in items of up to `item_rows` rows:
// each non-empty slot one item more than its share of whole items.
QP_API int qp_moe_items(int slots, int group_slots, int item_rows) { return qp::moe_items(slots, group_slots, item_rows); }

// k splits of one expert launch of `items` items of `item_rows` rows (qp::moe_splits).
QP_API int qp_moe_splits(int items, int item_rows, int k, int n, int target_ctas, long long partial_floats,
                         long long counters) {
    return qp::moe_splits(items, item_rows, k, n, target_ctas, partial_floats, counters);
}

// The sort step's plan on the host (for tests): offsets (E + 1), group_work (groups + 1) and each slot's first work
// item (E) from per-slot pick counts, in items of up to `item_rows` rows.
QP_API void qp_moe_plan_host(const int* counts, int E, const int* group_lo, int groups, int* offsets, int* group_work,
                             int* item_base, int item_rows) {
    qp::moe_plan_groups(counts, E, group_lo, groups, offsets, group_work, item_base, item_rows);
}

// Sort `slots` picks (ids: int32 or int64 expert ids, -1 for another rank's) over E slots in `groups` K groups
// (group_lo: host array, the first slot of each), cut into work items of up to `item_rows` rows (16: qp_moe_gemm;
// 64: qp_moe_tc_gemm). Returns 0, a CUDA error code, or -1 (bad sizes).
QP_API int qp_moe_sort(const void* ids, int ids64, const long long* perm, int slots, int E, const int* group_lo,
                       int groups, int item_rows, int* slot_of, int* offsets, int* sorted, int* work, int* group_work,
                       void* stream) {
    if (slots <= 0 || E <= 0 || groups < 1 || groups > qp::MOE_MAX_GROUPS || group_lo[0] != 0 || item_rows < 1)
        return -1;
    qp::MoeSort r{};
    r.ids = ids;
    r.perm = perm;
    r.ids64 = ids64;
    r.slots = slots;
    r.E = E;
    r.item_rows = item_rows;
    r.groups = groups;
    for (int g = 0; g < groups; ++g) {
        if (group_lo[g] >= E || (g > 0 && group_lo[g] <= group_lo[g - 1])) return -1;
        r.group_lo[g] = group_lo[g];
    }
    r.slot_of = slot_of;
    r.offsets = offsets;
    r.sorted = sorted;
    r.work = work;
    r.group_work = group_work;
    const size_t smem = (size_t)(4 * E + 1) * sizeof(int);
    if (smem > 48 * 1024) return -1;
    qp::moe_sort_kernel<<<1, qp::MOE_SORT_THREADS, smem, static_cast<cudaStream_t>(stream)>>>(r);
    return (int)cudaGetLastError();
}

namespace qp {

// The dynamic shared memory of an expert CTA of (codebook, 2K) in bytes, or -2 (no such K) / -3 (bad codebook).
inline int moe_smem(int codebook, int k2) {
    return with_codebook_k(codebook, k2, [&](auto, auto ka, auto half) {
        return moe_smem_bytes<decltype(ka)::value, decltype(half)::value>();
    });
}

// CTAs of the expert kernel that fit in one SM at once with `smem` bytes of dynamic shared memory, the largest K
// among the bank's groups being k2max / 2 (*fit; cached per device and k2max). Raises the kernel's shared-memory
// limit to the largest any K needs once per device. Returns 0 or a CUDA error code.
template <int CB, bool DOWN>
int moe_configure(int k2max, int smem, int* fit) {
    static int fits[64][17] = {};  // per device and 2K; 0 = not measured yet
    int slot = 0;
    if (const int e = device_slot(&slot)) return e;
    // k2max: 2..16, checked by moe_smem
    return configure_kernel(trellis_moe_kernel<CB, DOWN>, moe_smem_bytes<8, false>(), smem, fits[slot][k2max], fit);
}

}  // namespace qp

// One expert launch for every K group of a bank: down = 0 runs gate and up (x -> gu), down = 1 the down projection
// (gu -> y); gated = 0 for ungated experts (gate alone, then relu(gate)^2 into down). group_k2 (host array) holds each of the `groups` K groups' 2K; `items` is the grid's z extent, the bound
// of the whole bank (qp_moe_items for the call's picks and all slots); k and n_proj are the stored reduction width
// and one projection's stored output width. Returns 0, a CUDA error code, -1 (bad geometry or a group count outside
// 1..16), -2 (no kernel for a group's K), -3 (bad codebook) or -4 (workspace too small).
QP_API int qp_moe_gemm(int down, int gated, const void* x, void* gu, float* y, const long long* tables, int E,
                              const int* sorted, const int* offsets, const int* work, const int* group_work,
                              int groups, const int* group_k2, const void* weights, int weights_dtype,
                              float* partials, long long partial_floats, int* counters, long long counters_len,
                              int items, int top_k, int x_width, int x_stride, int k, int n_proj, int codebook,
                              int bf16, int target_ctas, void* stream) {
    if (items <= 0) return 0;
    if (groups < 1 || groups > qp::MOE_MAX_GROUPS || group_k2 == nullptr) return -1;
    qp::MoeParams p;
    int e = qp::moe_params(p, down, gated, x, gu, y, tables, E, sorted, offsets, work, group_work, weights, weights_dtype,
                           partials, counters, items, top_k, x_width, x_stride, k, n_proj, bf16);
    if (e != 0) return e;
    p.groups = groups;
    int smem = 0, k2max = 0;
    for (int g = 0; g < groups; ++g) {
        const int b = qp::moe_smem(codebook, group_k2[g]);
        if (b < 0) return b;
        p.group_k2[g] = group_k2[g];
        if (b > smem) smem = b;
        if (group_k2[g] > k2max) k2max = group_k2[g];
    }
    int fit = 0;
    switch (codebook) {
        case qp::CB_3INST: e = down ? qp::moe_configure<qp::CB_3INST, true>(k2max, smem, &fit)
                                    : qp::moe_configure<qp::CB_3INST, false>(k2max, smem, &fit); break;
        case qp::CB_MCG: e = down ? qp::moe_configure<qp::CB_MCG, true>(k2max, smem, &fit)
                                  : qp::moe_configure<qp::CB_MCG, false>(k2max, smem, &fit); break;
        default: e = down ? qp::moe_configure<qp::CB_MUL1, true>(k2max, smem, &fit)
                          : qp::moe_configure<qp::CB_MUL1, false>(k2max, smem, &fit); break;
    }
    if (e != 0) return e;
    e = qp::moe_plan(p, fit, items, qp::MOE_ROWS, target_ctas, partial_floats, counters_len);
    if (e != 0) return e;
    const dim3 grid(p.n / qp::BLOCK_N, p.splits, items);
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (codebook) {
        case qp::CB_3INST:
            if (down) qp::trellis_moe_kernel<qp::CB_3INST, true><<<grid, qp::THREADS, smem, s>>>(p);
            else qp::trellis_moe_kernel<qp::CB_3INST, false><<<grid, qp::THREADS, smem, s>>>(p);
            break;
        case qp::CB_MCG:
            if (down) qp::trellis_moe_kernel<qp::CB_MCG, true><<<grid, qp::THREADS, smem, s>>>(p);
            else qp::trellis_moe_kernel<qp::CB_MCG, false><<<grid, qp::THREADS, smem, s>>>(p);
            break;
        default:
            if (down) qp::trellis_moe_kernel<qp::CB_MUL1, true><<<grid, qp::THREADS, smem, s>>>(p);
            else qp::trellis_moe_kernel<qp::CB_MUL1, false><<<grid, qp::THREADS, smem, s>>>(p);
            break;
    }
    return (int)cudaGetLastError();
}

// out[t, :hidden] = the sum of token t's weighted down rows in y (row stride hidden_stored), in the model dtype.
QP_API int qp_moe_reduce(const float* y, const int* slot_of, void* out, int tokens, int top_k, int hidden_stored,
                         int hidden, int out_stride, int bf16, void* stream) {
    if (tokens <= 0) return 0;
    if (hidden > hidden_stored || top_k < 1) return -1;
    const long total = (long)tokens * hidden;
    qp::moe_reduce_kernel<<<(unsigned)((total + 255) / 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        y, slot_of, out, tokens, top_k, hidden_stored, hidden, out_stride, bf16);
    return (int)cudaGetLastError();
}
