// The pieces the trellis_mma kernels share (linear.cu: the linear layers; moe.cu: the expert banks): tile geometry,
// the decode of a lane's 8 weights of a 16x16 trellis tile straight into its mma.m16n8k16 B fragment (host + device,
// so the host checks it against the codec without a GPU), the cp.async / ldmatrix / mma wrappers, the 128-point
// Hadamard transform, the warp's trellis stream (TileStream) and the A slices that stream with it (ARing), and the
// mapping of run-time (codebook, 2K) to template constants (with_codebook_k).
//
// Each .cu including this header is its own translation unit (library.py builds them in parallel and links one
// shared library); everything here is inline or a template.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#define QP_API extern "C" __attribute__((visibility("default")))

namespace qp {

constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int GROUP = 4;             // tiles along k that one cp.async round of a warp loads
constexpr int GROUPS_IN_FLIGHT = 4;  // ring depth per warp, in groups
constexpr int BLOCK_N = 128;  // output columns per CTA = one Hadamard block
constexpr int F_STRIDE = BLOCK_N + 4;
constexpr float HAD_SCALE = 0.08838834764831845f;  // 1 / sqrt(128)
constexpr int TAIL_ROWS = 128;  // up to 16 rows: at most splits x rows partial rows summed by a block's last CTA

enum Codebook { CB_3INST = 0, CB_MCG = 1, CB_MUL1 = 2 };

// Geometry of one tile for K = KA (+ 0.5 when HALFK): uint32 words, the ring of bits, where each lane's window starts.
template <int KA, bool HALFK>
struct Tile {
    static constexpr int WORDS = 8 * KA + (HALFK ? 4 : 0);
    static constexpr int BYTES = WORDS * 4;
    static constexpr int CHUNKS = BYTES / 16;  // cp.async 16-byte pieces
    static constexpr int RING = WORDS * 32;    // bits
    // end of slot j's state, in bits after the lane's window start (the window starts 16 bits before the lane's
    // first new bit): (j + 1) * K rounded as the format does for half-integer K
    __host__ __device__ static constexpr int end(int j) { return 16 + (j + 1) * KA + (HALFK ? (j + 1) / 2 : 0); }
    static constexpr int NORM = (end(7) + 31) / 32;  // normalized 32-bit registers the window needs
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&a)[4], const void* smem) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(s));
}

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The integer intrinsics the decode uses, with host versions of the same semantics: the decode below also builds for
// the host, where qp_decode_tile_host() checks it against the project's codec without a GPU.
__host__ __device__ __forceinline__ uint32_t funnel_l(uint32_t lo, uint32_t hi, uint32_t shift) {
#ifdef __CUDA_ARCH__
    return __funnelshift_l(lo, hi, shift);
#else
    shift &= 31;  // the high word of (hi:lo) << shift
    return shift ? (hi << shift) | (lo >> (32 - shift)) : hi;
#endif
}

__host__ __device__ __forceinline__ uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t selector) {
#ifdef __CUDA_ARCH__
    return __byte_perm(x, y, selector);
#else
    const uint64_t bytes = (uint64_t(y) << 32) | x;  // byte i of the result is byte (selector nibble i) of y:x
    uint32_t r = 0;
    for (int i = 0; i < 4; ++i) r |= uint32_t((bytes >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return r;
#endif
}

__host__ __device__ __forceinline__ uint32_t byte_sum(uint32_t x, uint32_t acc) {  // acc + the four bytes of x
#ifdef __CUDA_ARCH__
    return __dp4a(x, 0x01010101u, acc);
#else
    return acc + (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24);
#endif
}

// Both halves: a + b, and a * b + c, rounded once to fp16 (on the host through fp32, which is exact for the operands
// the codebooks produce: docs/exl3-format.md, "The math", step 3).
__host__ __device__ __forceinline__ uint32_t half2_add(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
    const __half2 v = __hadd2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
    return *reinterpret_cast<const uint32_t*>(&v);
#else
    uint32_t r = 0;
    for (int i = 0; i < 2; ++i) {
        const float f = __half2float(__ushort_as_half((unsigned short)(a >> (16 * i)))) +
                        __half2float(__ushort_as_half((unsigned short)(b >> (16 * i))));
        r |= uint32_t(__half_as_ushort(__float2half_rn(f))) << (16 * i);
    }
    return r;
#endif
}

__host__ __device__ __forceinline__ uint32_t half2_fma_scalar(uint32_t a, unsigned short b, unsigned short c) {
#ifdef __CUDA_ARCH__
    const __half2 v = __hfma2(*reinterpret_cast<const __half2*>(&a), __halves2half2(__ushort_as_half(b), __ushort_as_half(b)),
                              __halves2half2(__ushort_as_half(c), __ushort_as_half(c)));
    return *reinterpret_cast<const uint32_t*>(&v);
#else
    uint32_t r = 0;
    for (int i = 0; i < 2; ++i) {
        const float f = __half2float(__ushort_as_half((unsigned short)(a >> (16 * i)))) *
                            __half2float(__ushort_as_half(b)) +
                        __half2float(__ushort_as_half(c));
        r |= uint32_t(__half_as_ushort(__float2half_rn(f))) << (16 * i);
    }
    return r;
#endif
}

// The high (low) half of a half2 in both halves.
__host__ __device__ __forceinline__ uint32_t dup_high(uint32_t a) {
#ifdef __CUDA_ARCH__
    const __half2 v = __high2half2(*reinterpret_cast<const __half2*>(&a));
    return *reinterpret_cast<const uint32_t*>(&v);
#else
    return (a >> 16) * 0x10001u;
#endif
}
__host__ __device__ __forceinline__ uint32_t dup_low(uint32_t a) {
#ifdef __CUDA_ARCH__
    const __half2 v = __low2half2(*reinterpret_cast<const __half2*>(&a));
    return *reinterpret_cast<const uint32_t*>(&v);
#else
    return (a & 0xFFFFu) * 0x10001u;
#endif
}

// 16-bit state of slot j from the lane's normalized window (bits read most significant first).
template <int KA, bool HALFK, int J>
__host__ __device__ __forceinline__ uint32_t state_of(const uint32_t (&w)[Tile<KA, HALFK>::NORM]) {
    constexpr int E = Tile<KA, HALFK>::end(J);
    constexpr int LO = E - 16;  // first bit of the state
    constexpr int R = LO / 32, SH = LO % 32;
    if constexpr (SH <= 16) {
        return (w[R] >> (16 - SH)) & 0xFFFFu;
    } else {
        return funnel_l(w[R + 1], w[R], SH) >> 16;
    }
}

// Two weights (stream slots a, b of the lane) as one half2: codebook value of each state.
template <int CB>
__host__ __device__ __forceinline__ uint32_t decode_pair(uint32_t sa, uint32_t sb) {
    if constexpr (CB == CB_MUL1) {
        const uint32_t xa = sa * 0x83DCD12Du, xb = sb * 0x83DCD12Du;
        // byte sums + the fp16 bit pattern of 1024: (1024 + b) as fp16 is 0x6400 + b for b < 1024
        const uint32_t ra = byte_sum(xa, 0x64006400u);
        const uint32_t rb = byte_sum(xb, 0u);
        return half2_fma_scalar(rb * 0x10000u + ra, 0x1EEE, 0xC931);
    } else {
        uint32_t xa, xb;
        if constexpr (CB == CB_MCG) {
            xa = sa * 0xCBAC1FEDu;
            xb = sb * 0xCBAC1FEDu;
        } else {
            xa = sa * 89226354u + 64248484u;
            xb = sb * 89226354u + 64248484u;
        }
        xa = (xa & 0x8FFF8FFFu) ^ 0x3B603B60u;
        xb = (xb & 0x8FFF8FFFu) ^ 0x3B603B60u;
        // each weight is the fp16 sum of its word's two halves: one half2 add per word with the other half broadcast
        // (an operand modifier, on the FMA pipe) and one permute, instead of two permutes on the ALU pipe, which
        // bounds these codebooks
        return byte_perm(half2_add(xa, dup_high(xa)), half2_add(xb, dup_low(xb)), 0x7610);
    }
}

// Where lane `lane`'s window starts in a tile: the word index of each of its NORM + 1 words and the bit shift that
// normalizes them (16 bits before the lane's first new bit, bit 8 * lane * K of the ring, onwards).
template <int KA, bool HALFK>
__host__ __device__ __forceinline__ void lane_window(int lane, int (&widx)[Tile<KA, HALFK>::NORM + 1], int& shift) {
    using T = Tile<KA, HALFK>;
    const int start = (lane * 8 * KA + (HALFK ? 4 * lane : 0) - 16 + T::RING) % T::RING;
    shift = start % 32;
    for (int j = 0; j <= T::NORM; ++j) widx[j] = (start / 32 + j) % T::WORDS;
}

// A lane's 8 weights of one tile as its B fragments of two mma.m16n8k16 (b[0], b[1]: tile columns 0-7; b[2], b[3]:
// columns 8-15). `pw[j]` points at the lane's window word j of the tile at offset 0 (the tile's words plus
// lane_window()'s widx[j]); `off` is the tile's offset in words from there, so that in the kernels' unrolled loops
// every load is one register plus an immediate.
template <int CB, int KA, bool HALFK>
__host__ __device__ __forceinline__ void decode_lane_at(const uint32_t* const (&pw)[Tile<KA, HALFK>::NORM + 1],
                                                        int off, int shift, uint32_t (&b)[4]) {
    using T = Tile<KA, HALFK>;
    uint32_t raw[T::NORM + 1];
#pragma unroll
    for (int j = 0; j <= T::NORM; ++j) raw[j] = pw[j][off];
    uint32_t w[T::NORM];
#pragma unroll
    for (int j = 0; j < T::NORM; ++j) w[j] = funnel_l(raw[j + 1], raw[j], shift);
    b[0] = decode_pair<CB>(state_of<KA, HALFK, 0>(w), state_of<KA, HALFK, 1>(w));
    b[1] = decode_pair<CB>(state_of<KA, HALFK, 2>(w), state_of<KA, HALFK, 3>(w));
    b[2] = decode_pair<CB>(state_of<KA, HALFK, 4>(w), state_of<KA, HALFK, 5>(w));
    b[3] = decode_pair<CB>(state_of<KA, HALFK, 6>(w), state_of<KA, HALFK, 7>(w));
}

// The same from the tile's words `tw` (shared or host memory) and the lane's window word indices.
template <int CB, int KA, bool HALFK>
__host__ __device__ __forceinline__ void decode_lane(const uint32_t* tw, const int (&widx)[Tile<KA, HALFK>::NORM + 1],
                                                     int shift, uint32_t (&b)[4]) {
    const uint32_t* pw[Tile<KA, HALFK>::NORM + 1];
#pragma unroll
    for (int j = 0; j <= Tile<KA, HALFK>::NORM; ++j) pw[j] = tw + widx[j];
    decode_lane_at<CB, KA, HALFK>(pw, 0, shift, b);
}

// The 128-point Sylvester Hadamard transform (unnormalized) of 128 values held 4 per lane (index lane * 4 + i).
__device__ __forceinline__ void fwht128(float (&v)[4], int lane) {
    const float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
    v[0] = a0 + a2;
    v[1] = a1 + a3;
    v[2] = a0 - a2;
    v[3] = a1 - a3;
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
        const bool upper = lane & m;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float o = __shfl_xor_sync(0xFFFFFFFFu, v[i], m);
            v[i] = upper ? o - v[i] : v[i] + o;
        }
    }
}

__device__ __forceinline__ float load_act(const void* p, size_t i, int bf16) {
    return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i])
                : __half2float(static_cast<const __half*>(p)[i]);
}

__device__ __forceinline__ void store_act(void* p, size_t i, float v, int bf16) {
    if (bf16)
        static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
    else
        static_cast<__half*>(p)[i] = __float2half_rn(v);
}

// had128 / sqrt(128) of a block input_load() read.
__device__ __forceinline__ void input_transform(float (&v)[4], int lane) {
    fwht128(v, lane);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] *= HAD_SCALE;
}

// One warp's column of tiles along k (a slice of `ktiles` tiles from `tiles`, consecutive tiles `tile_stride` bytes
// apart), streamed through the warp's private cp.async ring of GROUPS_IN_FLIGHT groups of GROUP tiles, decoded in
// registers and multiplied with an A panel in shared memory. Group g sits in ring slot g % GROUPS_IN_FLIGHT; groups
// are issued in order, so each lane keeps a running pointer to its pieces of the next group, and panel() is unrolled
// over the ring's slots, so every shared-memory address in it is a register fixed for the whole call plus an
// immediate. The linear and the expert kernels run their k loops through it.
// No A side in the stream: the k loop's A panel is in shared memory before the loop (the in-CTA transform, the
// expert kernel).
struct NoARing {
    template <int S>
    __device__ __forceinline__ void issue() {}
};

// The A side of a streamed k loop (the rows whose transformed input had128(x * suh) one launch wrote to xh before
// the GEMM): the chunk's MROWS rows, GROUP * 16 k columns per group, copied by cp.async into a ring of
// GROUPS_IN_FLIGHT slots in the same commit groups as the warps' trellis rings. The slots are the CTA's, shared by
// its warps, so the k loop waits on a CTA barrier per group (TileStream::streamed()) instead of waiting for a whole
// panel before its first tile. Rows beyond the chunk's are not copied: their slot rows keep stale values, which
// reach only mma output rows that are never stored (an output row depends on its own A row only).
template <int MB>
struct ARing {
    static constexpr int MROWS = 16 * MB;
    static constexpr int STRIDE = GROUP * 16 + 8;       // halves per row (+16 bytes: ldmatrix rows on distinct banks)
    static constexpr int SLOT = MROWS * STRIDE;         // halves per slot
    static constexpr int BYTES = GROUPS_IN_FLIGHT * SLOT * 2;
    static constexpr int PIECES = MROWS * GROUP * 2;    // 16-byte pieces per group
    static constexpr int PER_THREAD = (PIECES + THREADS - 1) / THREADS;

    __half* dst[PER_THREAD];        // this thread's pieces in slot 0 (nullptr: none)
    const __half* src[PER_THREAD];  // and where the next group's come from

    // slots: the ring (BYTES of shared memory); xh_chunk: the chunk's row 0 of xh at the CTA's first k column; k:
    // xh's row stride in halves; rows: the chunk's rows.
    __device__ __forceinline__ ARing(__half* slots, const __half* xh_chunk, int k, int rows) {
#pragma unroll
        for (int r = 0; r < PER_THREAD; ++r) {
            const int c = threadIdx.x + THREADS * r, m = c / (GROUP * 2), q = c % (GROUP * 2);
            const bool mine = (PIECES % THREADS == 0 || c < PIECES) && m < rows;
            dst[r] = mine ? slots + m * STRIDE + q * 8 : nullptr;
            src[r] = xh_chunk + (size_t)m * k + q * 8;
        }
    }

    template <int S>
    __device__ __forceinline__ void issue() {
#pragma unroll
        for (int r = 0; r < PER_THREAD; ++r) {
            if (dst[r] != nullptr) cp_async16(dst[r] + S * SLOT, src[r]);
            src[r] += GROUP * 16;
        }
    }
};

template <int CB, int KA, bool HALFK, class ASide = NoARing>
struct TileStream {
    using T = Tile<KA, HALFK>;
    static constexpr int GROUP_WORDS = GROUP * T::WORDS;
    static constexpr int PIECES = GROUP * T::CHUNKS;  // 16-byte pieces per group
    static constexpr int PER_LANE = (PIECES + 31) / 32;
    static_assert(GROUPS_IN_FLIGHT == 4, "the prologue and panel() assume a ring of 4 groups");

    uint32_t* wring;               // the warp's ring (GROUPS_IN_FLIGHT * GROUP_WORDS words)
    const uint8_t* src[PER_LANE];  // this lane's pieces (tile in group, 16-byte piece) of the next group to issue
    size_t group_stride;
    int to_issue;                    // groups not issued yet
    const uint32_t* pw[T::NORM + 1];  // the lane's window words in ring slot 0
    int shift;
    int lane;
    ASide aside;  // the A slices that stream with the groups (ARing), or none

    // Sets up the lane's pointers and issues the first GROUPS_IN_FLIGHT - 1 groups.
    __device__ __forceinline__ TileStream(uint32_t* warp_ring, const uint8_t* tiles, size_t tile_stride, int ktiles,
                                          int lane_, const ASide& aside_ = ASide{})
        : wring(warp_ring), group_stride(GROUP * tile_stride), to_issue(ktiles / GROUP), lane(lane_), aside(aside_) {
#pragma unroll
        for (int r = 0; r < PER_LANE; ++r) {
            const int c = lane + 32 * r;
            src[r] = tiles + (size_t)(c / T::CHUNKS) * tile_stride + (c % T::CHUNKS) * 16;
        }
        issue<0>();
        issue<1>();
        issue<2>();
        int widx[T::NORM + 1];
        lane_window<KA, HALFK>(lane, widx, shift);
#pragma unroll
        for (int j = 0; j <= T::NORM; ++j) pw[j] = wring + widx[j];
    }

    // The next group into ring slot S (an empty commit past the slice keeps the wait count exact).
    template <int S>
    __device__ __forceinline__ void issue() {
        if (to_issue > 0) {
            uint32_t* dst = wring + S * GROUP_WORDS;
#pragma unroll
            for (int r = 0; r < PER_LANE; ++r) {
                if (PIECES % 32 == 0 || lane + 32 * r < PIECES) cp_async16(dst + (lane + 32 * r) * 4, src[r]);
                src[r] += group_stride;
            }
            aside.template issue<S>();
            --to_issue;
        }
        cp_async_commit();
    }

    // Decode the tiles of the group in ring slot S and multiply them with MB 16-row fragments of A from a_k (this
    // lane's address of the group's first k column; rows A_STRIDE halves apart).
    template <int S, int MB, int A_STRIDE>
    __device__ __forceinline__ void multiply(const __half* a_k, float (&acc)[MB][2][4]) {
#pragma unroll
        for (int u = 0; u < GROUP; ++u) {
            uint32_t b[4];
            decode_lane_at<CB, KA, HALFK>(pw, S * GROUP_WORDS + u * T::WORDS, shift, b);
#pragma unroll
            for (int m = 0; m < MB; ++m) {
                uint32_t a[4];
                ldmatrix_x4(a, a_k + m * 16 * A_STRIDE + u * 16);
                mma16816(acc[m][0], a, b[0], b[1]);
                mma16816(acc[m][1], a, b[2], b[3]);
            }
        }
    }

    // The group in ring slot S: refill the slot freed last, wait for this one, decode and multiply (multiply()).
    template <int S, int MB, int A_STRIDE>
    __device__ __forceinline__ void group(const __half* a_k, float (&acc)[MB][2][4]) {
        issue<(S + GROUPS_IN_FLIGHT - 1) % GROUPS_IN_FLIGHT>();
        cp_async_wait<GROUPS_IN_FLIGHT - 1>();
        __syncwarp();
        multiply<S, MB, A_STRIDE>(a_k, acc);
        __syncwarp();  // every lane has read the group before a later issue refills its slot
    }

    // The group in ring slot S when the A slices stream with the groups (ARing: slot S of the A ring at a_lane +
    // S * A_SLOT): wait for this group, a CTA barrier (every thread's pieces of it have landed, and every warp is done
    // with the group before it, whose slots the issue below refills), then the next issue, decode and multiply.
    template <int S, int MB, int A_STRIDE, int A_SLOT>
    __device__ __forceinline__ void group_streamed(const __half* a_lane, float (&acc)[MB][2][4]) {
        cp_async_wait<GROUPS_IN_FLIGHT - 2>();
        __syncthreads();
        issue<(S + GROUPS_IN_FLIGHT - 1) % GROUPS_IN_FLIGHT>();
        multiply<S, MB, A_STRIDE>(a_lane + S * A_SLOT, acc);
    }

    // All `ktiles` tiles of the slice with streamed A slices, four groups (both rings' four slots) at a time; ktiles
    // is a multiple of 8 (two groups), as in panel().
    template <int MB, int A_STRIDE, int A_SLOT>
    __device__ __forceinline__ void streamed(const __half* a_lane, int ktiles, float (&acc)[MB][2][4]) {
        const int groups = ktiles / GROUP;
        int g = 0;
        for (; g + GROUPS_IN_FLIGHT <= groups; g += GROUPS_IN_FLIGHT) {
            group_streamed<0, MB, A_STRIDE, A_SLOT>(a_lane, acc);
            group_streamed<1, MB, A_STRIDE, A_SLOT>(a_lane, acc);
            group_streamed<2, MB, A_STRIDE, A_SLOT>(a_lane, acc);
            group_streamed<3, MB, A_STRIDE, A_SLOT>(a_lane, acc);
        }
        if (g < groups) {
            group_streamed<0, MB, A_STRIDE, A_SLOT>(a_lane, acc);
            group_streamed<1, MB, A_STRIDE, A_SLOT>(a_lane, acc);
        }
    }

    // The next `ptiles` tiles against a panel whose k column 0 is at a_lane, four groups (the ring's four slots) at a
    // time. The kernels' panels (PANEL: 64 or 32 tiles, asserted a multiple of 16 there) start at a multiple of 4
    // groups of the CTA's slice, and slices and k are multiples of 8 tiles (k of 128 columns; the host's slice
    // formulas round to 8 tiles), so a panel's first group sits in slot 0 and after the whole rounds either none or
    // two groups remain.
    template <int MB, int A_STRIDE>
    __device__ __forceinline__ void panel(const __half* a_lane, int ptiles, float (&acc)[MB][2][4]) {
        const __half* a_k = a_lane;
        const int groups = ptiles / GROUP;
        int g = 0;
        for (; g + GROUPS_IN_FLIGHT <= groups; g += GROUPS_IN_FLIGHT) {
            group<0, MB, A_STRIDE>(a_k, acc);
            group<1, MB, A_STRIDE>(a_k + GROUP * 16, acc);
            group<2, MB, A_STRIDE>(a_k + 2 * GROUP * 16, acc);
            group<3, MB, A_STRIDE>(a_k + 3 * GROUP * 16, acc);
            a_k += GROUPS_IN_FLIGHT * GROUP * 16;
        }
        if (g < groups) {
            group<0, MB, A_STRIDE>(a_k, acc);
            group<1, MB, A_STRIDE>(a_k + GROUP * 16, acc);
        }
    }
};


// Calls f(cb, ka, half) with the template constants (std::integral_constant / bool_constant) of a codebook id and
// 2K: integer K 1..8 for every codebook, K 1.5 / 2.5 / 3.5 for mul1. Returns f's result, -2 (no such K) or -3 (bad
// codebook). The one place that maps run-time ids to kernel instantiations (launches and the host decode).
template <int CB, class F>
int with_k(int k2, F&& f) {
    using std::bool_constant, std::integral_constant;
    const auto cb = integral_constant<int, CB>{};
    switch (k2) {
        case 2: return f(cb, integral_constant<int, 1>{}, bool_constant<false>{});
        case 4: return f(cb, integral_constant<int, 2>{}, bool_constant<false>{});
        case 6: return f(cb, integral_constant<int, 3>{}, bool_constant<false>{});
        case 8: return f(cb, integral_constant<int, 4>{}, bool_constant<false>{});
        case 10: return f(cb, integral_constant<int, 5>{}, bool_constant<false>{});
        case 12: return f(cb, integral_constant<int, 6>{}, bool_constant<false>{});
        case 14: return f(cb, integral_constant<int, 7>{}, bool_constant<false>{});
        case 16: return f(cb, integral_constant<int, 8>{}, bool_constant<false>{});
        default: break;
    }
    if constexpr (CB == CB_MUL1) {
        switch (k2) {
            case 3: return f(cb, integral_constant<int, 1>{}, bool_constant<true>{});
            case 5: return f(cb, integral_constant<int, 2>{}, bool_constant<true>{});
            case 7: return f(cb, integral_constant<int, 3>{}, bool_constant<true>{});
            default: break;
        }
    }
    return -2;
}

template <class F>
int with_codebook_k(int codebook, int k2, F&& f) {
    switch (codebook) {
        case CB_3INST: return with_k<CB_3INST>(k2, f);
        case CB_MCG: return with_k<CB_MCG>(k2, f);
        case CB_MUL1: return with_k<CB_MUL1>(k2, f);
        default: return -3;
    }
}

// The calling thread's device as an index into the per-device caches below (64 entries). Returns 0 or a CUDA error.
inline int device_slot(int* slot) {
    int device = 0;
    const cudaError_t e = cudaGetDevice(&device);
    *slot = device & 63;
    return (int)e;
}

// Raises a kernel's dynamic shared-memory limit to `limit` bytes and measures how many of its CTAs (THREADS threads,
// `smem` bytes each) fit in one SM, once: `cached` (0 = not yet) is the caller's per-device (and per-shape) entry.
// Call at warm-up, before any CUDA-graph capture. *fit (where given) the count. Returns 0 or a CUDA error code.
template <class Kernel>
int configure_kernel(Kernel kernel, int limit, int smem, int& cached, int* fit) {
    if (cached == 0) {
        cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit);
        if (e != cudaSuccess) return (int)e;
        int n = 0;
        e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, THREADS, smem);
        if (e != cudaSuccess) return (int)e;
        cached = n > 0 ? n : 1;
    }
    if (fit != nullptr) *fit = cached;
    return 0;
}

}  // namespace qp
