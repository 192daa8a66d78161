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

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QP_WGMMA 1
#endif

namespace qp {

constexpr int TC_SWIZZLE_ALIGN = 1024;  // a 128-byte-swizzled tile starts at a multiple of 8 rows of 128 bytes

__device__ __forceinline__ void cp_async16_s(uint32_t smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem));
}

// Shared-memory stores and cp.async results become visible to the async proxy (wgmma's operand reads).
__device__ __forceinline__ void fence_async_shared() {
#ifdef QP_WGMMA
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_fence() {
#ifdef QP_WGMMA
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef QP_WGMMA
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef QP_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Keeps registers live (and their accesses ordered) up to this point: an A register set stays allocated until the
// wgmma reading it is known to be done, and the accumulators are not touched while a wgmma may write them.
template <int N>
__device__ __forceinline__ void keep(uint32_t (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int N, int M>
__device__ __forceinline__ void keep(uint32_t (&r)[N][M]) {
#pragma unroll
    for (int i = 0; i < N; ++i) keep(r[i]);
}
template <int N>
__device__ __forceinline__ void keep(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// The shared-memory matrix descriptor of a K-major, 128-byte-swizzled tile at shared address `smem` (rows of 128
// bytes, 8-row groups 1024 bytes apart; the leading byte offset is unused in this layout).
__device__ __forceinline__ uint64_t smem_desc(uint32_t smem) {
    return (uint64_t)((smem & 0x3FFFF) >> 4) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

template <int NR>
struct Wgmma;

template <>
struct Wgmma<64> {
    __device__ __forceinline__ static void mma(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
#ifdef QP_WGMMA
        asm volatile(
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
            "%0, %1, %2, %3, %4, %5, %6, %7,"
            "%8, %9, %10, %11, %12, %13, %14, %15,"
            "%16, %17, %18, %19, %20, %21, %22, %23,"
            "%24, %25, %26, %27, %28, %29, %30, %31"
            "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#endif
    }
};

template <>
struct Wgmma<128> {
    __device__ __forceinline__ static void mma(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
#ifdef QP_WGMMA
        asm volatile(
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
            "%0, %1, %2, %3, %4, %5, %6, %7,"
            "%8, %9, %10, %11, %12, %13, %14, %15,"
            "%16, %17, %18, %19, %20, %21, %22, %23,"
            "%24, %25, %26, %27, %28, %29, %30, %31,"
            "%32, %33, %34, %35, %36, %37, %38, %39,"
            "%40, %41, %42, %43, %44, %45, %46, %47,"
            "%48, %49, %50, %51, %52, %53, %54, %55,"
            "%56, %57, %58, %59, %60, %61, %62, %63"
            "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 0;\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
              "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#endif
    }
};

template <>
struct Wgmma<256> {
    __device__ __forceinline__ static void mma(float (&d)[128], const uint32_t (&a)[4], uint64_t desc) {
#ifdef QP_WGMMA
        asm volatile(
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {"
            "%0, %1, %2, %3, %4, %5, %6, %7,"
            "%8, %9, %10, %11, %12, %13, %14, %15,"
            "%16, %17, %18, %19, %20, %21, %22, %23,"
            "%24, %25, %26, %27, %28, %29, %30, %31,"
            "%32, %33, %34, %35, %36, %37, %38, %39,"
            "%40, %41, %42, %43, %44, %45, %46, %47,"
            "%48, %49, %50, %51, %52, %53, %54, %55,"
            "%56, %57, %58, %59, %60, %61, %62, %63,"
            "%64, %65, %66, %67, %68, %69, %70, %71,"
            "%72, %73, %74, %75, %76, %77, %78, %79,"
            "%80, %81, %82, %83, %84, %85, %86, %87,"
            "%88, %89, %90, %91, %92, %93, %94, %95,"
            "%96, %97, %98, %99, %100, %101, %102, %103,"
            "%104, %105, %106, %107, %108, %109, %110, %111,"
            "%112, %113, %114, %115, %116, %117, %118, %119,"
            "%120, %121, %122, %123, %124, %125, %126, %127"
            "}, {%128, %129, %130, %131}, %132, 1, 1, 1, 0;\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
              "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
              "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
              "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
              "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
              "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
              "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
              "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
              "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
              "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#endif
    }
};

// The B side of the k loop: the chunk's NR rows of xh, 64 k columns per group, copied by cp.async into a ring of
// GROUPS_IN_FLIGHT slots in TileStream's commit groups. Row m's 16-byte piece q lands at m * 128 + (q ^ (m % 8)) *
// 16 of its slot (the 128-byte swizzle). Thread i copies pieces q = i % 8 of rows i / 8 + 32 r: one swizzled column
// for all its rows. Rows beyond the chunk's are not copied: their slot rows keep stale values, which reach only
// output rows that are never stored (an output row of the GEMM depends on its own input row only).
template <int NR>
struct BRing {
    static_assert(NR % 32 == 0, "whole 32-row steps per thread");
    static constexpr int SLOT = NR * 128;  // bytes
    static constexpr int BYTES = GROUPS_IN_FLIGHT * SLOT;
    static constexpr int PER_THREAD = NR * 8 / THREADS;

    uint32_t dst;       // this thread's first piece in slot 0 (shared address)
    const __half* src;  // and its first piece of the next group
    int k;              // xh's row stride in halves
    int mine;           // bit r: piece r is a row of the chunk

    __device__ __forceinline__ BRing(uint32_t slots, const __half* xh_chunk, int k_, int rows) : k(k_), mine(0) {
        const int m = threadIdx.x / 8, q = threadIdx.x % 8;
        dst = slots + m * 128 + ((q ^ (m % 8)) * 16);
        src = xh_chunk + (size_t)m * k + q * 8;
#pragma unroll
        for (int r = 0; r < PER_THREAD; ++r)
            if (m + 32 * r < rows) mine |= 1 << r;
    }

    template <int S>
    __device__ __forceinline__ void issue() {
#pragma unroll
        for (int r = 0; r < PER_THREAD; ++r)
            if ((mine >> r) & 1) cp_async16_s(dst + S * SLOT + r * 32 * 128, src + (size_t)r * 32 * k);
        src += GROUP * 16;
    }
};

// The k loop of a CTA: all ktiles tiles (a multiple of 8) of the warp's tile column against the CTA's NR rows, as a
// software pipeline over groups of GROUP k tiles: while the wgmmas of group g run, the CTA waits for group g + 1's
// data, refills the ring slots of group g - 1 (whose wgmmas are done by then) with group g + 3, and decodes group
// g + 1's four tiles into the other register set (four independent decode chains, so their latencies overlap).
template <int CB, int KA, bool HALFK, int NR>
struct TcLoop {
    using T = Tile<KA, HALFK>;
    using Stream = TileStream<CB, KA, HALFK, BRing<NR>>;

    // The group in ring slot S as this warp's A fragments, one per k tile (see the file's head).
    template <int S>
    __device__ __forceinline__ static void decode(const Stream& st, uint32_t (&a)[GROUP][4]) {
#pragma unroll
        for (int u = 0; u < GROUP; ++u) {
            uint32_t b[4];
            decode_lane_at<CB, KA, HALFK>(st.pw, S * Stream::GROUP_WORDS + u * T::WORDS, st.shift, b);
            a[u][0] = b[0];
            a[u][1] = b[2];
            a[u][2] = b[1];
            a[u][3] = b[3];
        }
    }

    // The wgmmas of the group in ring slot S, one commit group each.
    template <int S>
    __device__ __forceinline__ static void mmas(float (&acc)[NR / 2], const uint32_t (&a)[GROUP][4],
                                                uint64_t desc0) {
        wgmma_fence();
#pragma unroll
        for (int u = 0; u < GROUP; ++u) {
            Wgmma<NR>::mma(acc, a[u], desc0 + ((S * BRing<NR>::SLOT + u * 32) >> 4));
            wgmma_commit();
        }
    }

    // Group g in ring slot S, its fragments in `cur`: its wgmmas, then, if a group follows, that group's data
    // awaited, the slots of group g - 1 refilled with group g + 3 and the next group decoded into `next`.
    template <int S>
    __device__ __forceinline__ static void step(Stream& st, uint64_t desc0, float (&acc)[NR / 2],
                                                uint32_t (&cur)[GROUP][4], uint32_t (&next)[GROUP][4], bool more) {
        mmas<S>(acc, cur, desc0);
        if (more) {
            cp_async_wait<GROUPS_IN_FLIGHT - 3>();  // group g + 1 has landed (issued: up to g + 2)
            wgmma_wait<GROUP>();                   // group g - 1's wgmmas are done: `next` and its slot are free
            keep(next);
            fence_async_shared();
            __syncthreads();
            st.template issue<(S + GROUPS_IN_FLIGHT - 1) % GROUPS_IN_FLIGHT>();
            decode<(S + 1) % GROUPS_IN_FLIGHT>(st, next);
        }
    }

    __device__ __forceinline__ static void run(Stream& st, uint64_t desc0, int ktiles, float (&acc)[NR / 2]) {
        const int groups = ktiles / GROUP;
        uint32_t a0[GROUP][4], a1[GROUP][4];
        cp_async_wait<GROUPS_IN_FLIGHT - 2>();  // group 0 has landed (issued: 0, 1, 2)
        fence_async_shared();
        __syncthreads();
        decode<0>(st, a0);
        int g = 0;
        for (; g + GROUPS_IN_FLIGHT <= groups; g += GROUPS_IN_FLIGHT) {
            step<0>(st, desc0, acc, a0, a1, true);
            step<1>(st, desc0, acc, a1, a0, true);
            step<2>(st, desc0, acc, a0, a1, true);
            step<3>(st, desc0, acc, a1, a0, g + GROUPS_IN_FLIGHT < groups);
        }
        if (g < groups) {  // two groups left (ktiles is a multiple of 8)
            step<0>(st, desc0, acc, a0, a1, true);
            step<1>(st, desc0, acc, a1, a0, false);
        }
        wgmma_wait<0>();
        keep(a0);
        keep(a1);
        keep(acc);
    }
};

// Dynamic shared memory of a CTA: the B ring at a 1024-byte boundary, then the warps' trellis rings; after the k
// loop the partial sums (NR rows of 128 floats) alias both.
template <int KA, bool HALFK, int NR>
__host__ __device__ constexpr int tc_smem_bytes() {
    constexpr int LOOP = BRing<NR>::BYTES + WARPS * GROUPS_IN_FLIGHT * GROUP * Tile<KA, HALFK>::BYTES;
    constexpr int F_BYTES = NR * F_STRIDE * 4;
    return TC_SWIZZLE_ALIGN + (LOOP > F_BYTES ? LOOP : F_BYTES);
}

// The accumulators into the partial sums F (row-major, NR rows x 128 columns, F_STRIDE floats per row): this thread
// holds columns 16 * warp + g (+ 8) of rows 8 i + 2 t (+ 1) (wgmma's accumulator layout, rows and columns swapped).
template <int NR>
__device__ __forceinline__ void tc_store_acc(float* F, const float (&acc)[NR / 2]) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int c = 16 * warp + lane / 4, r = 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < NR / 8; ++i) {
        F[(8 * i + r) * F_STRIDE + c] = acc[4 * i];
        F[(8 * i + r + 1) * F_STRIDE + c] = acc[4 * i + 1];
        F[(8 * i + r) * F_STRIDE + c + 8] = acc[4 * i + 2];
        F[(8 * i + r + 1) * F_STRIDE + c + 8] = acc[4 * i + 3];
    }
}

}  // namespace qp

namespace qp {

// One CTA: column block nb x k tiles [kt0, kt0 + ktiles) x rows [chunk * NR, +NR) of the launch (see the file's
// head). With `partials_only` the CTA stores its raw sums (before the output transform) to p.partials as (chunk,
// split, NR, n) instead: the GEMM stage alone, for tests.
template <int CB, int KA, bool HALFK, int NR>
__device__ __forceinline__ void tc_cta(const Params& p, uint8_t* smem_raw, int& last_arrival, int nb, int kt0,
                                       int ktiles, int chunk, int split, bool partials_only) {
    using Loop = TcLoop<CB, KA, HALFK, NR>;
    using T = Tile<KA, HALFK>;
    uint8_t* smem = reinterpret_cast<uint8_t*>(
        (reinterpret_cast<uintptr_t>(smem_raw) + TC_SWIZZLE_ALIGN - 1) & ~uintptr_t(TC_SWIZZLE_ALIGN - 1));
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
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e != cudaSuccess) return (int)e;
    int& cached = fits[device & 63];
    if (cached == 0) {
        auto kernel = trellis_tc_kernel<CB, KA, HALFK, NR>;
        constexpr int smem = tc_smem_bytes<KA, HALFK, NR>();
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e != cudaSuccess) return (int)e;
        int n = 0;
        e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, THREADS, smem);
        if (e != cudaSuccess) return (int)e;
        cached = n > 0 ? n : 1;
    }
    *fit = cached;
    return 0;
}

// Calls f with the NR constant of a row block size (64, 128 or 256). Returns f's result or -1.
template <class F>
int with_nr(int nr, F&& f) {
    switch (nr) {
        case 64: return f(std::integral_constant<int, 64>{});
        case 128: return f(std::integral_constant<int, 128>{});
        case 256: return f(std::integral_constant<int, 256>{});
        default: return -1;
    }
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
