// The tensor-core machinery (Hopper, sm_90a) the dense kernel (tc.cu) and the expert kernel (moe_tc.cu) share:
// the wgmma wrappers, the B ring of transformed rows in 128-byte-swizzled shared memory (BRing), the software
// pipeline over groups of k tiles with the decoded trellis as the register A operand (TcLoop), the shared-memory
// size of a CTA (tc_smem_bytes) and the accumulators' way into the partial sums (tc_store_acc). tc.cu's head
// describes the scheme. Each unit including this header is built for sm_90a on Hopper (library.py: Unit);
// elsewhere the wgmma instructions compile to nothing and the kernels using them trap.

#pragma once

#include "common.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QP_WGMMA 1
#endif

namespace qp {

constexpr int TC_SWIZZLE_ALIGN = 1024;  // a 128-byte-swizzled tile starts at a multiple of 8 rows of 128 bytes

// A CTA's dynamic shared memory from its first 1024-byte boundary (the B ring's swizzle; tc_smem_bytes() counts the
// bytes skipped).
__device__ __forceinline__ uint8_t* tc_align(uint8_t* smem_raw) {
    return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + TC_SWIZZLE_ALIGN - 1) &
                                      ~uintptr_t(TC_SWIZZLE_ALIGN - 1));
}

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


}  // namespace qp
