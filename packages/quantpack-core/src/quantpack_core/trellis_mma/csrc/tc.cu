// The tensor-core trellis GEMM for 17 rows and more (Hopper, sm_90a): wgmma with the decoded weights as its register
// operand.
//
// y = had128(xh @ What) * svh per 128-column block, as the split-K kernel computes it, with the roles of the operands
// swapped: each warpgroup computes D = What^T (64 output columns x 16 k) x xh^T (16 k x NR rows) per k step with one
// wgmma.mma_async m64nNRk16, whose A operand comes from registers and whose B operand, NR rows of the transformed
// input, comes from shared memory. A lane's 8 decoded weights of a 16 x 16 trellis tile are its B fragment of two
// mma.m16n8k16 (the format's tensor-core placement); the same four registers, reordered, are its A fragment of
// What^T: a0 = (column g, k 2t..2t+1) = b0, a1 = (column g + 8, k 2t..) = b2, a2 = (column g, k 2t + 8..) = b1,
// a3 = b3 (g = lane / 4, t = lane % 4). So each tile is decoded once per CTA, in registers, and feeds NR rows
// (64, 128 or 256) of tensor-core work, against once per 16 or 64 rows in the split-K kernel.
//
// Per CTA (8 warps = 2 warpgroups; 128 output columns = one Hadamard block; NR rows; a slice of k):
//   1. Each warp streams its tile column's trellis through its private cp.async ring (TileStream), and the CTA
//      streams the NR rows of xh (written by the input transform launch) in the same cp.async groups into a ring of
//      4 slots (BRing), each slot NR rows x 64 k (128 bytes per row, 128-byte swizzled: the canonical K-major layout
//      wgmma's shared-memory descriptors read).
//   2. A software pipeline over groups of 4 k tiles (TcLoop): the 4 wgmmas of group g are issued on one register set
//      holding its decoded tiles; while they run, the CTA waits for group g + 1, refills the slots of group g - 1
//      (whose wgmmas are done: wgmma.wait_group 4) with group g + 3, and decodes group g + 1 into the other set.
//   3. The accumulators (NR / 2 per thread: 64 columns x NR rows per warpgroup) go to shared memory as the split-K
//      kernel's partial sums, and from there the same end as there: split-K partials summed by a column block's last
//      CTA in split order, the output Hadamard transform, svh, the shard's columns (tc_finish).

#include "common.cuh"
#include "linear.cuh"
#include "tc.cuh"

namespace qp {

// One CTA: column block nb x k tiles [kt0, kt0 + ktiles) x rows [chunk * NR, +NR) of the launch (see the file's
// head). With `partials_only` the CTA stores its raw sums (before the output transform) to p.partials as (chunk,
// split, NR, n) instead: the GEMM stage alone, for tests.
template <int CB, int KA, bool HALFK, int NR>
__device__ __forceinline__ void tc_cta(const Params& p, uint8_t* smem_raw, int& last_arrival, int nb, int kt0,
                                       int ktiles, int chunk, int split, bool partials_only) {
    using Loop = TcLoop<CB, KA, HALFK, NR>;
    using T = Tile<KA, HALFK>;
    uint8_t* smem = tc_align(smem_raw);
    float* F = reinterpret_cast<float*>(smem);
    uint32_t* ring = reinterpret_cast<uint32_t*>(smem + BRing<NR>::BYTES);
    const uint32_t b_slots = static_cast<uint32_t>(__cvta_generic_to_shared(smem));

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = chunk * NR;
    const int rows = min(p.rows - row0, NR);
    const int si = shard_of(p, nb);
    const int lnb = nb - field(p, si, &Shard::block0);
    const int ntiles_n = field(p, si, &Shard::n) / 16;
    const uint8_t* trellis = field(p, si, &Shard::trellis);
    const int tn = lnb * (BLOCK_N / 16) + warp;
    const size_t tile_stride = (size_t)ntiles_n * T::BYTES;
    uint32_t* warp_ring = ring + warp * GROUPS_IN_FLIGHT * Loop::Stream::GROUP_WORDS;
    const uint8_t* warp_tiles = trellis + ((size_t)kt0 * ntiles_n + tn) * T::BYTES;
    const __half* xh = static_cast<const __half*>(p.xh) + ((size_t)si * p.rows + row0) * p.k + (size_t)kt0 * 16;

    float acc[NR / 2];
#pragma unroll
    for (int i = 0; i < NR / 2; ++i) acc[i] = 0.0f;
    typename Loop::Stream st(warp_ring, warp_tiles, tile_stride, ktiles, lane, BRing<NR>(b_slots, xh, p.k, rows));
    Loop::run(st, smem_desc(b_slots), ktiles, acc);
    cp_async_wait<0>();
    __syncthreads();
    tc_store_acc<NR>(F, acc);
    __syncthreads();
    if (partials_only) {
        float* mine = p.partials + ((size_t)(chunk * p.splits + split) * NR) * p.n + (size_t)nb * BLOCK_N;
        for (int e = threadIdx.x; e < rows * BLOCK_N; e += THREADS)
            mine[(size_t)(e / BLOCK_N) * p.n + e % BLOCK_N] = F[(e / BLOCK_N) * F_STRIDE + e % BLOCK_N];
        return;
    }
    finish_block(p, F, last_arrival, si, nb, lnb, chunk, split, row0, rows);
}

// The split plan of the tensor-core kernel: a CTA per (column block, split, chunk of NR rows).
template <int CB, int KA, bool HALFK, int NR>
__global__ void __launch_bounds__(THREADS, NR == 256 ? 1 : 2) trellis_tc_kernel(const Params p, int partials_only) {
#if defined(__CUDA_ARCH__) && !defined(QP_WGMMA)
    __trap();  // built without sm_90a's wgmma: the host side never launches this
#else
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ int last_arrival;
    const int split = blockIdx.y, kt0 = split * p.slice_tiles;
    tc_cta<CB, KA, HALFK, NR>(p, smem, last_arrival, blockIdx.x, kt0, min(p.slice_tiles, p.k / 16 - kt0), blockIdx.z,
                              split, partials_only != 0);
#endif
}

}  // namespace qp

namespace qp {

template <int CB, int KA, bool HALFK, int NR>
int tc_configure(int* fit) {
    static int fits[64] = {};  // per device; 0 = not configured yet
    int slot = 0;
    if (const int e = device_slot(&slot)) return e;
    constexpr int smem = tc_smem_bytes<KA, HALFK, NR>();
    return configure_kernel(trellis_tc_kernel<CB, KA, HALFK, NR>, smem, smem, fits[slot], fit);
}

// CTAs of the tensor-core kernel of (codebook, 2K, NR) that fit in one SM at once (*fit).
inline int tc_resident_ctas(int codebook, int k2, int nr, int* fit) {
    return with_nr(nr, [&](auto n) {
        return with_codebook_k(codebook, k2, [&](auto cb, auto ka, auto half) {
            return tc_configure<decltype(cb)::value, decltype(ka)::value, decltype(half)::value, decltype(n)::value>(
                fit);
        });
    });
}

inline int tc_launch(const Params& p, int codebook, int k2, int nr, dim3 grid, int partials_only, cudaStream_t s) {
    return with_nr(nr, [&](auto n) {
        return with_codebook_k(codebook, k2, [&](auto cb, auto ka, auto half) {
            constexpr int CB = decltype(cb)::value, KA = decltype(ka)::value, NR = decltype(n)::value;
            constexpr bool HALFK = decltype(half)::value;
            int fit = 0;
            const int e = tc_configure<CB, KA, HALFK, NR>(&fit);
            if (e != 0) return e;
            trellis_tc_kernel<CB, KA, HALFK, NR>
                <<<grid, THREADS, tc_smem_bytes<KA, HALFK, NR>(), s>>>(p, partials_only);
            return (int)cudaGetLastError();
        });
    });
}

}  // namespace qp

// Rows per CTA of the tensor-core kernel for a call of `rows` rows: 64 up to 64 rows, 128 up to 192, else 256.
QP_API int qp_trellis_tc_rows(int rows) { return rows <= 64 ? 64 : rows <= 192 ? 128 : 256; }

// Splits of k for the tensor-core kernel: chunks of nr rows (qp::split_count).
QP_API int qp_trellis_tc_splits(int rows, int nr, int k, int n, int target_ctas, long long partial_floats,
                                long long counters) {
    return qp::split_count(rows, nr, k, n, target_ctas, k / 128, partial_floats, counters);
}

// As qp_trellis_mma, with the tensor-core kernel (sm_90a) after the input transform launch: `nr` rows per CTA (64,
// 128 or 256; 0: qp_trellis_tc_rows). With `partials_only` (tests) one split, and each CTA stores its raw sums to
// partials as (chunk, nr, n) float32 instead of finishing the block. Returns as qp_trellis_mma, or -6 (this device
// is not sm_90).
QP_API int qp_trellis_tc(const void* x, void* xh, const void* const* trellis, const void* const* suh,
                         const void* const* svh, const int* n, const int* col, const int* out_features, int shards,
                         void* out, float* partials, long long partial_floats, int* counters, long long counters_len,
                         int rows, int x_width, int x_stride, int k, int out_stride, int codebook, int k2, int bf16,
                         int target_ctas, int nr, int partials_only, void* stream) {
    if (rows <= 0) return 0;
    if (shards < 1 || shards > qp::MAX_SHARDS) return -5;
    if (k % 128 || k <= 0 || x_width > k || xh == nullptr) return xh == nullptr ? -4 : -1;
    int device = 0, sms = 0, major = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
        return (int)cudaGetLastError();
    if (major != 9) return -6;
    if (nr == 0) nr = qp_trellis_tc_rows(rows);
    qp::Params p{};
    int n_total = 0;
    int e = qp::fill_shards(p, trellis, suh, svh, n, col, out_features, shards, n_total);
    if (e != 0) return e;
    int fit = 0;
    e = qp::tc_resident_ctas(codebook, k2, nr, &fit);
    if (e != 0) return e;
    if ((long long)fit * sms < target_ctas) target_ctas = fit * sms;
    const int chunks = (rows + nr - 1) / nr;
    const int splits = partials_only ? 1 : qp_trellis_tc_splits(rows, nr, k, n_total, target_ctas, partial_floats,
                                                                 counters_len);
    const int ktiles = k / 16;
    p.x = x;
    p.xh = xh;
    p.out = out;
    p.partials = partials;
    p.counters = counters;
    p.shards = shards;
    p.rows = rows;
    p.x_width = x_width;
    p.x_stride = x_stride;
    p.k = k;
    p.n = n_total;
    p.out_stride = out_stride;
    p.slice_tiles = (ktiles / 8 + splits - 1) / splits * 8;
    p.splits = splits;
    p.mrows = partials_only ? nr : (rows < nr ? rows : nr);
    p.bf16 = bf16;
    if ((splits > 1 || partials_only) && ((long long)chunks * splits * p.mrows * n_total > partial_floats ||
                                          (long long)chunks * (n_total / qp::BLOCK_N) > counters_len))
        return -4;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (x != nullptr) {  // no x: xh holds the transformed input already (tests)
        e = qp::launch_input_transform(p, s);
        if (e != 0) return e;
    }
    return qp::tc_launch(p, codebook, k2, nr, dim3(n_total / qp::BLOCK_N, splits, chunks), partials_only, s);
}
