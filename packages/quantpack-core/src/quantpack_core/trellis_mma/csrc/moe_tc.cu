// The expert banks' tensor-core path (Hopper, sm_90a): the grouped expert GEMM for many tokens, on the dense
// tensor-core kernel's machinery (tc.cuh: TcLoop, BRing, Wgmma, tc_store_acc) and the 16-row expert kernel's plan
// and end (moe.cuh). Per projection (gate/up, then down) of one chunk of picks:
//
//   sort       as for the 16-row kernel (moe.cu), with work items of NR = 64 rows: a slot's picks in sorted
//              order, NR at a time.
//   transform  a warp per (plane, sorted position, 128-column block): the pick's input row times the projection's
//              suh, had128 / sqrt(128), in fp16 to row `position` of plane `plane` of xh. Gate/up: x[token] with w1's
//              suh (plane 0) and w3's (plane 1; none when ungated); down: silu(gate) * up from gu (ungated:
//              relu(gate)^2) with w2's suh. Positions past the call's held picks (offsets[E]) return at once.
//   gemm       a CTA per (128-column block, k split, work item), for every K group in one launch (moe_group_k: a
//              switch over the item's group's K): B = the item's NR consecutive rows of xh (the BRing of tc.cu, rows
//              past the item's not copied), A = its expert's trellis tiles of the block's columns (tables), decoded
//              once per CTA into wgmma's register operand (TcLoop); the sums go to shared memory (tc_store_acc) and
//              the CTA ends as the 16-row kernel's do (moe_finish: split-K partials, output Hadamard transform, svh,
//              fp16 rows of gu or weighted fp32 rows of y). The reduction is moe.cu's.
//
// Every size is a bound that depends on the token count only (the transform's grid on the chunk's picks, the gemm's
// z extent on moe_items for NR-row items), so the launches are graph-safe, as the 16-row path's. Off Hopper the
// kernels trap and the entry returns -6 before any launch; the op never chooses this path there.

#include "common.cuh"
#include "moe.cuh"
#include "tc.cuh"

namespace qp {

// The transformed input rows of every held pick into xh (see the file's head); `positions` bounds the sorted
// positions (the chunk's picks).
template <bool DOWN>
__global__ void __launch_bounds__(THREADS) moe_transform_kernel(const MoeParams p, int positions) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int blocks = p.k / 128;
    const int planes = DOWN || !p.gated ? 1 : 2;
    const long item = (long)blockIdx.x * WARPS + warp;
    if (item >= (long)planes * positions * blocks) return;
    const int plane = item / ((long)positions * blocks), pos = item / blocks % positions, b = item % blocks;
    if (pos >= p.offsets[p.E]) return;
    const int pick = p.sorted[pos];
    const int proj = DOWN ? 2 : plane;
    const __half* suh = reinterpret_cast<const __half*>(p.tables[(3 * proj + 1) * p.E + p.slot_of[pick]]);
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = b * 128 + lane * 4 + i;
        v[i] = moe_input<DOWN>(p, DOWN ? pos : pick, c, __half2float(suh[c]));
    }
    input_transform(v, lane);
    __half2* dst = reinterpret_cast<__half2*>(p.xh + ((size_t)plane * p.xh_plane + pos) * p.k + b * 128 + lane * 4);
    dst[0] = __floats2half2_rn(v[0], v[1]);
    dst[1] = __floats2half2_rn(v[2], v[3]);
}

// One CTA of the expert GEMM: 128 output columns (blockIdx.x) x one k slice (blockIdx.y) of work item w (blockIdx.z),
// whose rows are the sorted positions base .. base + rows of xh's plane of the projection.
template <int CB, int KA, bool HALFK, int NR, bool DOWN>
__device__ __forceinline__ void moe_tc_cta(const MoeParams& p, int w, uint8_t* smem_raw, int& last_arrival) {
    using Loop = TcLoop<CB, KA, HALFK, NR>;
    using T = Tile<KA, HALFK>;
    uint8_t* smem = tc_align(smem_raw);
    float* F = reinterpret_cast<float*>(smem);
    uint32_t* ring = reinterpret_cast<uint32_t*>(smem + BRing<NR>::BYTES);
    const uint32_t b_slots = static_cast<uint32_t>(__cvta_generic_to_shared(smem));

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int nb = blockIdx.x, split = blockIdx.y;
    const int slot = p.work[2 * w], r0 = p.work[2 * w + 1];
    const int base = p.offsets[slot] + r0;
    const int rows = min(p.offsets[slot + 1] - base, NR);
    // gate/up's first n_proj / 128 column blocks are gate (w1, xh plane 0), the rest up (w3, plane 1); down is w2
    const int blocks_proj = p.n_proj / BLOCK_N;
    const int proj = DOWN ? 2 : nb / blocks_proj;
    const int lnb = DOWN ? nb : nb % blocks_proj;
    const uint8_t* trellis = reinterpret_cast<const uint8_t*>(p.tables[(3 * proj + 0) * p.E + slot]);
    const int ntiles_n = p.n_proj / 16;
    const int kt0 = split * p.slice_tiles;
    const int ktiles = min(p.slice_tiles, p.k / 16 - kt0);
    const int tn = lnb * (BLOCK_N / 16) + warp;
    const size_t tile_stride = (size_t)ntiles_n * T::BYTES;
    uint32_t* warp_ring = ring + warp * GROUPS_IN_FLIGHT * Loop::Stream::GROUP_WORDS;
    const uint8_t* warp_tiles = trellis + ((size_t)kt0 * ntiles_n + tn) * T::BYTES;
    const __half* xh = p.xh + ((size_t)(DOWN ? 0 : proj) * p.xh_plane + base) * p.k + (size_t)kt0 * 16;

    float acc[NR / 2];
#pragma unroll
    for (int i = 0; i < NR / 2; ++i) acc[i] = 0.0f;
    typename Loop::Stream st(warp_ring, warp_tiles, tile_stride, ktiles, lane, BRing<NR>(b_slots, xh, p.k, rows));
    Loop::run(st, smem_desc(b_slots), ktiles, acc);
    cp_async_wait<0>();
    __syncthreads();
    tc_store_acc<NR>(F, acc);
    __syncthreads();
    moe_finish<DOWN>(p, F, last_arrival, NR, rows, proj, lnb, slot, base);
}

// Every K group of a bank in one launch (as trellis_moe_kernel): grid z runs over the bound of the call's work items.
template <int CB, int NR, bool DOWN>
__global__ void __launch_bounds__(THREADS, NR == 256 ? 1 : 2) trellis_moe_tc_kernel(const MoeParams p) {
#if defined(__CUDA_ARCH__) && !defined(QP_WGMMA)
    __trap();  // built without sm_90a's wgmma: the host side never launches this
#else
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ int last_arrival;
    const int w = blockIdx.z;
    if (w >= p.group_work[p.groups]) return;
    moe_group_k<CB>(p, w, [&](auto ka, auto half) {
        moe_tc_cta<CB, decltype(ka)::value, decltype(half)::value, NR, DOWN>(p, w, smem, last_arrival);
    });
#endif
}

// Calls f with the NR constant of the expert path's rows per work item. Returns f's result or -1. 64 only: with 128
// rows, the kernel's every-K switch no longer inlines (ptxas serializes its wgmmas across the call: warning C7510).
template <class F>
int with_moe_nr(int nr, F&& f) {
    return nr == 64 ? f(std::integral_constant<int, 64>{}) : -1;
}

// CTAs of the expert GEMM of (CB, NR, DOWN) that fit in one SM with `smem` bytes of dynamic shared memory, the bank's
// largest K being k2max / 2 (*fit; cached per device, NR and k2max). Raises the kernel's shared-memory limit to the
// largest any K needs once per device. Returns 0 or a CUDA error code.
template <int CB, int NR, bool DOWN>
int moe_tc_configure(int k2max, int smem, int* fit) {
    static int fits[64][17] = {};  // per device and 2K; 0 = not measured yet
    int slot = 0;
    if (const int e = device_slot(&slot)) return e;
    // k2max: 2..16, checked by the caller
    return configure_kernel(trellis_moe_tc_kernel<CB, NR, DOWN>, tc_smem_bytes<8, false, NR>(), smem,
                            fits[slot][k2max], fit);
}

// The transform launch and the GEMM launch of one projection (p planned; smem: the largest of the bank's K groups).
template <int CB, int NR, bool DOWN>
int moe_tc_launch(MoeParams& p, int k2max, int smem, int items, int positions, int target_ctas,
                  long long partial_floats, long long counters_len, cudaStream_t s) {
    int fit = 0;
    int e = moe_tc_configure<CB, NR, DOWN>(k2max, smem, &fit);
    if (e != 0) return e;
    e = moe_plan(p, fit, items, NR, target_ctas, partial_floats, counters_len);
    if (e != 0) return e;
    const long warps = (long)(DOWN || !p.gated ? 1 : 2) * positions * (p.k / 128);
    moe_transform_kernel<DOWN><<<(unsigned)((warps + WARPS - 1) / WARPS), THREADS, 0, s>>>(p, positions);
    e = (int)cudaGetLastError();
    if (e != 0) return e;
    trellis_moe_tc_kernel<CB, NR, DOWN><<<dim3(p.n / BLOCK_N, p.splits, items), THREADS, smem, s>>>(p);
    return (int)cudaGetLastError();
}

}  // namespace qp

// One projection of the expert path on the tensor cores: the transform launch (x or gu -> xh) and the GEMM launch
// for every K group (down = 0: gate and up, x -> gu; down = 1: gu -> y); arguments as qp_moe_gemm's, plus the sort's
// slot_of, xh (fp16, xh_halves long: at least (gate/up of a gated bank: 2, else 1) x positions x k), `positions` (the
// chunk's picks: the bound of the sorted positions) and `nr` (rows per work item, 64: the sort's item_rows;
// `items` is qp_moe_items for them). Returns as qp_moe_gemm, or -6 (this device is not sm_90).
QP_API int qp_moe_tc_gemm(int down, int gated, const void* x, void* gu, float* y, void* xh, long long xh_halves,
                          const long long* tables, int E, const int* slot_of, const int* sorted, const int* offsets,
                          const int* work, const int* group_work, int groups, const int* group_k2,
                          const void* weights, int weights_dtype, float* partials, long long partial_floats,
                          int* counters, long long counters_len, int positions, int items, int nr, int top_k,
                          int x_width, int x_stride, int k, int n_proj, int codebook, int bf16, int target_ctas,
                          void* stream) {
    if (items <= 0 || positions <= 0) return 0;
    if (groups < 1 || groups > qp::MOE_MAX_GROUPS || group_k2 == nullptr || nr != 64) return -1;
    qp::MoeParams p;
    int e = qp::moe_params(p, down, gated, x, gu, y, tables, E, sorted, offsets, work, group_work, weights,
                           weights_dtype, partials, counters, items, top_k, x_width, x_stride, k, n_proj, bf16);
    if (e != 0) return e;
    if (xh == nullptr || (long long)(down || !p.gated ? 1 : 2) * positions * k > xh_halves) return -4;
    p.groups = groups;
    p.slot_of = slot_of;
    p.xh = static_cast<__half*>(xh);
    p.xh_plane = positions;
    int smem = 0, k2max = 0;
    for (int g = 0; g < groups; ++g) {
        const int b = qp::with_moe_nr(nr, [&](auto n) {
            return qp::with_codebook_k(codebook, group_k2[g], [&](auto, auto ka, auto half) {
                return qp::tc_smem_bytes<decltype(ka)::value, decltype(half)::value, decltype(n)::value>();
            });
        });
        if (b < 0) return b;
        p.group_k2[g] = group_k2[g];
        if (b > smem) smem = b;
        if (group_k2[g] > k2max) k2max = group_k2[g];
    }
    int device = 0, major = 0;  // geometry first: bad arguments are refused before any CUDA call
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
        return (int)cudaGetLastError();
    if (major != 9) return -6;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    return qp::with_moe_nr(nr, [&](auto n) {
        constexpr int NR = decltype(n)::value;
        switch (codebook) {
            case qp::CB_3INST:
                return down ? qp::moe_tc_launch<qp::CB_3INST, NR, true>(p, k2max, smem, items, positions, target_ctas,
                                                                        partial_floats, counters_len, s)
                            : qp::moe_tc_launch<qp::CB_3INST, NR, false>(p, k2max, smem, items, positions,
                                                                         target_ctas, partial_floats, counters_len, s);
            case qp::CB_MCG:
                return down ? qp::moe_tc_launch<qp::CB_MCG, NR, true>(p, k2max, smem, items, positions, target_ctas,
                                                                      partial_floats, counters_len, s)
                            : qp::moe_tc_launch<qp::CB_MCG, NR, false>(p, k2max, smem, items, positions, target_ctas,
                                                                       partial_floats, counters_len, s);
            default:
                return down ? qp::moe_tc_launch<qp::CB_MUL1, NR, true>(p, k2max, smem, items, positions, target_ctas,
                                                                       partial_floats, counters_len, s)
                            : qp::moe_tc_launch<qp::CB_MUL1, NR, false>(p, k2max, smem, items, positions,
                                                                        target_ctas, partial_floats, counters_len, s);
        }
    });
}
