// EXL3 linear layer for few rows: the trellis is decoded in registers straight into tensor-core fragments.
//
// y = had128(had128(x * suh) @ What) * svh for one EXL3 shard (docs/exl3-format.md, "The math"), where What is stored
// as 16x16 trellis tiles; up to 16 rows, one launch runs several shards that share the input (a layer's q / k / v or
// gate / up, same K and codebook) from a table of shards, each CTA finding its shard from its column block. One CTA owns 128 output columns (one Hadamard block, 8 tile columns, one per warp) and a
// slice of the reduction dimension k; every lane of a warp decodes 8 of the 256 weights of each tile, which land
// exactly in its B fragment of two mma.m16n8k16 (the format's tensor-core placement, step 4), so the decoded weights
// never touch memory and each tile is decoded once for up to 64 rows (MB fragments of 16 rows).
//
// Per CTA:
//   1. The transformed input had128(x * suh) (fp16): with FUSED (one row, when inline_rows allows) a one-row panel
//      of up to 1024 columns is built in shared memory from x by the CTA itself; otherwise the
//      transform kernel below wrote it once for all column blocks and it streams into a ring of A slices in the
//      CTA's shared memory, one slice per trellis group, in the same cp.async groups (ARing).
//   2. Each warp streams its tile column's trellis through a private cp.async ring (GROUPS_IN_FLIGHT groups of GROUP
//      tiles along k, one group per cp.async instruction per lane), decodes each tile (state extraction by funnel shifts from a lane's 16 + 8K bit window, the codebook hash, one fp16
//      add / fma per pair of weights) and multiplies it with the panel's A fragments into fp32 accumulators.
//   3. The 128-column partial sums go to shared memory. With a split of k over several CTAs (split-K, for parallelism
//      when there are few column blocks), each CTA stores its partial to a workspace and the last CTA of the column
//      block (an arrival counter) sums the partials in split order, so results are deterministic and a CUDA-graph
//      replay is bit-identical to an eager call.
//   4. The CTA that holds the full sums applies the output Hadamard transform, svh, and writes the shard's columns
//      of the output in the model dtype.
//
// Host entry points are plain C (extern "C") and take device pointers and a cudaStream_t, so the library builds
// with nvcc alone and loads with ctypes (quantpack_exl3/backends/trellis_mma/library.py).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <map>
#include <mutex>
#include <tuple>
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
constexpr int MAX_SHARDS = 8;  // shards one launch runs
constexpr int TAIL_ROWS = 128;  // up to 16 rows: at most splits x rows partial rows summed by a block's last CTA
constexpr int WIDE_PARTS = 8;   // stream-K above 16 rows: at most this many parts of a column block (the split plan's
                                // splits at 64 rows with 2 CTAs per SM on the 8B shapes)
constexpr int PANEL_BATCH = 2;  // input blocks a warp loads before transforming them (memory-level parallelism)

enum Codebook { CB_3INST = 0, CB_MCG = 1, CB_MUL1 = 2 };

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
    long long units;  // stream-K: k units (128 columns) of the launch's column blocks, per chunk
    int ctas;         // stream-K: CTAs per chunk
    int mrows;  // rows per chunk in the partials (min(rows, 16 * MB))
    int bf16;   // x and out are bf16 (else fp16)
};

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

// x * suh of one row's 128-column block (lane holds 4 values), zero beyond x_width.
__device__ __forceinline__ void input_load(const Params& p, const __half* suh, int row, int kc, int lane,
                                           float (&v)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = kc + lane * 4 + i;
        v[i] = c < p.x_width ? load_act(p.x, (size_t)row * p.x_stride + c, p.bf16) * __half2float(suh[c]) : 0.0f;
    }
}

// had128 / sqrt(128) of a block input_load() read.
__device__ __forceinline__ void input_transform(float (&v)[4], int lane) {
    fwht128(v, lane);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] *= HAD_SCALE;
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

// A CTA's k units (k / 128 per column block, blocks in order) under stream-K (up to 64 rows, one chunk): CTA c of `ctas` takes units
// [c * units / ctas, (c + 1) * units / ctas); owner() is the CTA whose range holds unit u.
struct StreamKPlan {
    long long units;
    int ctas;
    __host__ __device__ long long start(int c) const { return (long long)c * units / ctas; }
    __host__ __device__ int owner(long long u) const { return (int)(((u + 1) * ctas - 1) / units); }
};

// One item of a stream-K CTA: column block nb, its k units [k0, k1), the slot its partial goes to (2 per CTA: its
// first item, and its last when that is a part of a block too), and the CTAs whose parts the block sums.
struct StreamKItem {
    int nb, k0, k1, slot, seg_first, seg_last;
};

// The item of CTA c (of `plan`, kunits units per block) that starts at unit u, its `item`-th.
__host__ __device__ __forceinline__ StreamKItem streamk_item(const StreamKPlan& plan, int kunits, int c, long long u,
                                                             int item) {
    StreamKItem it;
    it.nb = (int)(u / kunits);
    it.k0 = (int)(u % kunits);
    const long long left = plan.start(c + 1) - u;
    it.k1 = left < kunits - it.k0 ? it.k0 + (int)left : kunits;
    it.slot = 2 * c + (item == 0 ? 0 : 1);
    it.seg_first = plan.owner((long long)it.nb * kunits);
    it.seg_last = plan.owner((long long)(it.nb + 1) * kunits - 1);
    return it;
}

// The slot where CTA c left its part of block nb: its first item's, unless nb is a later (its last) item.
__host__ __device__ __forceinline__ int streamk_slot(const StreamKPlan& plan, int kunits, int c, int nb) {
    return 2 * c + (plan.start(c) / kunits == nb ? 0 : 1);
}

// The CTA's work on one item: the chunk's rows x column block nb x k tiles [kt0, kt0 + ktiles), then the item's
// end. With the split plan (STREAMK false) the item is (column block, split): its partial goes to the split's rows
// of the workspace and the block's last CTA sums the p.splits partials. With stream-K the item is a CTA's share of
// a block (a CTA's range of k units may span blocks: StreamKPlan): a whole block writes its output directly, a
// part goes to the CTA's slot (`slot`: 2 per CTA, its first and its last item) and the last of the block's CTAs
// `seg_first`..`seg_last` sums their slots in that order. Returns early (nothing left to do) when another CTA sums.
// Dynamic shared memory of one kernel instantiation: the A panel (or, after it, the 128-column partial sums) and the
// warps' trellis rings.
template <int KA, bool HALFK, int MB, bool FUSED>
__host__ __device__ constexpr int smem_bytes() {
    constexpr int MROWS = 16 * MB;
    constexpr int A_BYTES = FUSED ? (64 * 16 + 8) * 2 : ARing<MB>::BYTES;  // FUSED: one row (cta_item)
    constexpr int F_BYTES = MROWS * F_STRIDE * 4;
    return (A_BYTES > F_BYTES ? A_BYTES : F_BYTES) + WARPS * GROUPS_IN_FLIGHT * GROUP * Tile<KA, HALFK>::BYTES;
}

template <int CB, int KA, bool HALFK, int MB, bool FUSED, bool STREAMK>
__device__ __forceinline__ void cta_item(const Params& p, uint8_t* smem, int& last_arrival, const int nb, const int kt0,
                                         const int ktiles, const int chunk, const int split, const int slot,
                                         const int seg_first, const int seg_last) {
    using T = Tile<KA, HALFK>;
    constexpr int MROWS = 16 * MB;
    static_assert(!FUSED || MB == 1, "the in-CTA transform builds one row of one 16-row fragment");
    constexpr int PANEL = 64;                 // FUSED: k tiles of A held in shared memory at once
    static_assert(PANEL % (GROUPS_IN_FLIGHT * GROUP) == 0, "TileStream::panel() needs panels of whole ring rounds");
    constexpr int A_STRIDE = PANEL * 16 + 8;  // halves; +16 bytes keeps ldmatrix rows on distinct banks
    // FUSED serves one row (the panel holds it once; every lane's ldmatrix row address is that row, so the 16-row
    // fragment is the row repeated and only its first output row is kept)
    constexpr int A_BYTES = FUSED ? A_STRIDE * 2 : ARing<MB>::BYTES;
    constexpr int F_BYTES = MROWS * F_STRIDE * 4;
    constexpr int AF_BYTES = A_BYTES > F_BYTES ? A_BYTES : F_BYTES;

    __half* A = reinterpret_cast<__half*>(smem);
    float* F = reinterpret_cast<float*>(smem);
    uint32_t* ring = reinterpret_cast<uint32_t*>(smem + AF_BYTES);
    static_assert(AF_BYTES + WARPS * GROUPS_IN_FLIGHT * GROUP * T::BYTES == smem_bytes<KA, HALFK, MB, FUSED>(),
                  "smem_bytes() sizes this CTA's shared memory");

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = chunk * MROWS;
    const int rows = min(p.rows - row0, MROWS);

    // this CTA's shard: only its index stays live, its fields are read where they are used (fewer registers)
    int si = 0;
#pragma unroll
    for (int i = 1; i < MAX_SHARDS; ++i)
        if (i < p.shards && nb >= p.shard[i].block0) si = i;
    const int lnb = nb - field(p, si, &Shard::block0);  // column block within the shard
    const int ntiles_n = field(p, si, &Shard::n) / 16;
    const uint8_t* trellis = field(p, si, &Shard::trellis);

    // this warp's tile column
    const int tn = lnb * (BLOCK_N / 16) + warp;
    const size_t tile_stride = (size_t)ntiles_n * T::BYTES;
    uint32_t* warp_ring = ring + warp * GROUPS_IN_FLIGHT * TileStream<CB, KA, HALFK>::GROUP_WORDS;
    const uint8_t* warp_tiles = trellis + ((size_t)kt0 * ntiles_n + tn) * T::BYTES;

    float acc[MB][2][4];
#pragma unroll
    for (int m = 0; m < MB; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][h][e] = 0.0f;

    if constexpr (FUSED) {
        TileStream<CB, KA, HALFK> stream(warp_ring, warp_tiles, tile_stride, ktiles, lane);
        const __half* a_lane = A + (lane / 16) * 8;  // row 0 for every lane: see A_BYTES
        const __half* suh = field(p, si, &Shard::suh);
        for (int p0 = 0; p0 < ktiles; p0 += PANEL) {
            const int ptiles = min(PANEL, ktiles - p0);
            // 1. the A panel had128(x * suh): one row of ptiles * 16 fp16 (rows is 1 here), its blocks of 128
            // columns PANEL_BATCH per warp loaded before any is transformed; every lane's fragment row reads it
            __syncthreads();
            const int kc0 = (kt0 + p0) * 16;
            const int blocks = ptiles / 8, items = rows * blocks;
            for (int item0 = warp * PANEL_BATCH; item0 < items; item0 += WARPS * PANEL_BATCH) {
                float v[PANEL_BATCH][4];
#pragma unroll
                for (int j = 0; j < PANEL_BATCH; ++j) {
                    const int item = item0 + j;
#pragma unroll
                    for (int i = 0; i < 4; ++i) v[j][i] = 0.0f;
                    if (item < items) input_load(p, suh, row0 + item / blocks, kc0 + item % blocks * 128, lane, v[j]);
                }
#pragma unroll
                for (int j = 0; j < PANEL_BATCH; ++j) {
                    const int item = item0 + j;
                    if (item < items) {  // warp-uniform
                        input_transform(v[j], lane);
                        __half2* dst = reinterpret_cast<__half2*>(A + item / blocks * A_STRIDE + item % blocks * 128 +
                                                                  lane * 4);
                        dst[0] = __floats2half2_rn(v[j][0], v[j][1]);
                        dst[1] = __floats2half2_rn(v[j][2], v[j][3]);
                    }
                }
            }
            __syncthreads();

            // 2. decode and multiply the panel's tiles
            stream.template panel<MB, A_STRIDE>(a_lane, ptiles, acc);
        }
    } else {
        // 1-2. the transformed input (xh, written by the transform launch) streams into the CTA's A ring in step
        // with the trellis groups; decode and multiply
        using AR = ARing<MB>;
        const __half* xh = static_cast<const __half*>(p.xh) + ((size_t)si * p.rows + row0) * p.k + (size_t)kt0 * 16;
        TileStream<CB, KA, HALFK, AR> stream(warp_ring, warp_tiles, tile_stride, ktiles, lane, AR(A, xh, p.k, rows));
        stream.template streamed<MB, AR::STRIDE, AR::SLOT>(A + (lane % 16) * AR::STRIDE + (lane / 16) * 8, ktiles,
                                                           acc);
    }
    cp_async_wait<0>();

    // 3. partial sums of the 128 columns into shared memory
    __syncthreads();
    {
        const int g = lane / 4, c = warp * 16 + 2 * (lane % 4);
#pragma unroll
        for (int m = 0; m < MB; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                F[(m * 16 + g) * F_STRIDE + c + h * 8] = acc[m][h][0];
                F[(m * 16 + g) * F_STRIDE + c + h * 8 + 1] = acc[m][h][1];
                F[(m * 16 + g + 8) * F_STRIDE + c + h * 8] = acc[m][h][2];
                F[(m * 16 + g + 8) * F_STRIDE + c + h * 8 + 1] = acc[m][h][3];
            }
    }
    __syncthreads();

    const int segments = STREAMK ? seg_last - seg_first + 1 : p.splits;
    if (segments > 1) {
        // partials and their sum move as float4 (a row's 128 columns are 32 of them; rows start 16-byte aligned in
        // the workspace, n being a multiple of 128, and in F, F_STRIDE a multiple of 4). Split plan: (chunk, split,
        // mrows, n); stream-K: (chunk, slot, mrows, 128)
        const size_t n0 = (size_t)nb * BLOCK_N;
        const size_t stride = STREAMK ? BLOCK_N : p.n;
        float* mine = STREAMK ? p.partials + (size_t)(chunk * 2 * p.ctas + slot) * p.mrows * BLOCK_N
                              : p.partials + ((size_t)(chunk * p.splits + split) * p.mrows) * p.n + n0;
        for (int e = threadIdx.x * 4; e < rows * BLOCK_N; e += THREADS * 4)
            *reinterpret_cast<float4*>(mine + (size_t)(e / BLOCK_N) * stride + e % BLOCK_N) =
                *reinterpret_cast<const float4*>(F + (e / BLOCK_N) * F_STRIDE + e % BLOCK_N);
        __threadfence();
        __syncthreads();
        int* counter = p.counters + (size_t)chunk * (p.n / BLOCK_N) + nb;
        if (threadIdx.x == 0) last_arrival = atomicAdd(counter, 1) == segments - 1;
        __syncthreads();
        if (!last_arrival) return;
        __threadfence();
        if constexpr (STREAMK) {
            // the block's parts in CTA order (deterministic), each from the slot its CTA wrote it to
            __shared__ int part_slot[TAIL_ROWS];
            const StreamKPlan plan{p.units, p.ctas};
            for (int i = threadIdx.x; i < segments; i += THREADS)
                part_slot[i] = streamk_slot(plan, p.k / 128, seg_first + i, nb);
            __syncthreads();
            const float* slots = p.partials + (size_t)chunk * 2 * p.ctas * p.mrows * BLOCK_N;
            for (int e = threadIdx.x * 4; e < rows * BLOCK_N; e += THREADS * 4) {
                float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
                for (int i = 0; i < segments; ++i) {
                    const float4 v =
                        __ldcg(reinterpret_cast<const float4*>(slots + (size_t)part_slot[i] * p.mrows * BLOCK_N + e));
                    s.x += v.x;
                    s.y += v.y;
                    s.z += v.z;
                    s.w += v.w;
                }
                *reinterpret_cast<float4*>(F + (e / BLOCK_N) * F_STRIDE + e % BLOCK_N) = s;
            }
        } else {
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
        }
        if (threadIdx.x == 0) *counter = 0;
        __syncthreads();
    }

    // 4. output Hadamard transform, svh, the shard's columns of the output
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


// The split plan: a CTA per (column block, split, row chunk).
template <int CB, int KA, bool HALFK, int MB, bool FUSED>
__global__ void __launch_bounds__(THREADS) trellis_mma_kernel(const Params p) {
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ int last_arrival;
    const int split = blockIdx.y, kt0 = split * p.slice_tiles;
    cta_item<CB, KA, HALFK, MB, FUSED, false>(p, smem, last_arrival, blockIdx.x, kt0,
                                              min(p.slice_tiles, p.k / 16 - kt0), blockIdx.z, split, 0, 0, 0);
}

// Stream-K (up to 64 rows, one chunk): CTA blockIdx.x walks its range of the launch's k units (StreamKPlan), an item
// per column block it meets. Up to 16 rows at most 64 registers, so that 4 CTAs fit an SM as with the split plan
// (the item loop's state would otherwise take 80; a few bytes spill); the 64-row kernel 2 CTAs per SM, as the split
// plan's default there (3 would spill 68 bytes in the k loop).
template <int CB, int KA, bool HALFK, int MB, bool FUSED>
__global__ void __launch_bounds__(THREADS, MB == 1 ? 4 : 2) trellis_mma_streamk_kernel(const Params p) {
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ int last_arrival;
    const StreamKPlan plan{p.units, p.ctas};
    const int c = blockIdx.x, kunits = p.k / 128;
    const long long u1 = plan.start(c + 1);
    long long u = plan.start(c);
    for (int item = 0; u < u1; ++item) {
        const StreamKItem it = streamk_item(plan, kunits, c, u, item);
        __syncthreads();  // the last item's output transform has read its sums (which alias the A panel)
        cta_item<CB, KA, HALFK, MB, FUSED, true>(p, smem, last_arrival, it.nb, it.k0 * 8, (it.k1 - it.k0) * 8, 0, 0,
                                                 it.slot, it.seg_first, it.seg_last);
        u += it.k1 - it.k0;
    }
}

// The kernel of an instantiation.
template <int CB, int KA, bool HALFK, int MB, bool FUSED, bool STREAMK>
inline auto kernel_of() {
    if constexpr (STREAMK) {
        return trellis_mma_streamk_kernel<CB, KA, HALFK, MB, FUSED>;
    } else {
        return trellis_mma_kernel<CB, KA, HALFK, MB, FUSED>;
    }
}

// had128(x * suh) / sqrt(128) of every row into xh (fp16, row stride k) for each of the launch's shards (shard i's
// rows at i * rows): one warp per 128-column block.
__global__ void __launch_bounds__(THREADS) input_transform_kernel(const Params p) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int blocks = p.k / 128;
    const long item = (long)blockIdx.x * WARPS + warp;
    if (item >= (long)p.shards * p.rows * blocks) return;
    const int si = item / ((long)p.rows * blocks), row = item / blocks % p.rows, b = item % blocks;
    float v[4];
    input_load(p, field(p, si, &Shard::suh), row, b * 128, lane, v);
    input_transform(v, lane);
    __half2* dst = reinterpret_cast<__half2*>(static_cast<__half*>(const_cast<void*>(p.xh)) +
                                              ((size_t)si * p.rows + row) * p.k + b * 128 + lane * 4);
    dst[0] = __floats2half2_rn(v[0], v[1]);
    dst[1] = __floats2half2_rn(v[2], v[3]);
}


// Raises a kernel instantiation's shared-memory limit once per device (at warm-up, before any CUDA-graph capture)
// and gives how many of its CTAs fit in one SM at once (*fit; cached with the limit). Returns 0 or a CUDA error code.
template <int CB, int KA, bool HALFK, int MB, bool FUSED, bool STREAMK>
int configure(int* fit) {
    static int fits[64] = {};  // per device; 0 = not configured yet
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e != cudaSuccess) return (int)e;
    int& cached = fits[device & 63];
    if (cached == 0) {
        auto kernel = kernel_of<CB, KA, HALFK, MB, FUSED, STREAMK>();
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<KA, HALFK, MB, FUSED>());
        if (e != cudaSuccess) return (int)e;
        int n = 0;
        e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, THREADS, smem_bytes<KA, HALFK, MB, FUSED>());
        if (e != cudaSuccess) return (int)e;
        cached = n > 0 ? n : 1;
    }
    *fit = cached;
    return 0;
}

template <int CB, int KA, bool HALFK, int MB, bool FUSED, bool STREAMK>
int launch(const Params& p, dim3 grid, cudaStream_t stream) {
    int fit = 0;
    const int e = configure<CB, KA, HALFK, MB, FUSED, STREAMK>(&fit);
    if (e != 0) return e;
    kernel_of<CB, KA, HALFK, MB, FUSED, STREAMK>()<<<grid, THREADS, smem_bytes<KA, HALFK, MB, FUSED>(), stream>>>(p);
    return (int)cudaGetLastError();
}

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

template <int MB, bool FUSED, bool STREAMK = false>
int dispatch(const Params& p, int codebook, int k2, dim3 grid, cudaStream_t s) {
    return with_codebook_k(codebook, k2, [&](auto cb, auto ka, auto half) {
        return launch<decltype(cb)::value, decltype(ka)::value, decltype(half)::value, MB, FUSED, STREAMK>(p, grid, s);
    });
}

// CTAs of the kernel a launch of (codebook, 2K, MB, FUSED) uses that fit in one SM at once (*fit). Returns 0, a CUDA
// error code, -2 (no such K) or -3 (bad codebook).
template <int MB, bool FUSED, bool STREAMK = false>
int resident_ctas(int codebook, int k2, int* fit) {
    return with_codebook_k(codebook, k2, [&](auto cb, auto ka, auto half) {
        return configure<decltype(cb)::value, decltype(ka)::value, decltype(half)::value, MB, FUSED, STREAMK>(fit);
    });
}

}  // namespace qp

// Plan of one call: how many CTAs split k, given the column blocks (n: all shards' stored columns) and row chunks.
// As many splits as keep the grid within target_ctas CTAs (one wave: a grid just above it, e.g. 560 CTAs for 528
// slots, would run a second wave of a few CTAs that the whole call waits for), whole 128-column blocks per split, up
// to 16 rows at most TAIL_ROWS partial rows summed by a column block's last CTA (splits x rows), and the partials and
// counters within the workspace.
QP_API int qp_trellis_mma_splits(int rows, int k, int n, int target_ctas, long long partial_floats,
                                 long long counters) {
    const int mb_rows = rows <= 16 ? 16 : 64;
    const int chunks = (rows + mb_rows - 1) / mb_rows;
    const int ktiles = k / 16, nbk = n / qp::BLOCK_N;
    const int mrows = rows < mb_rows ? rows : mb_rows;
    const long long ctas = (long long)nbk * chunks;
    int splits = (int)(target_ctas / ctas);
    const int max_splits = ktiles / 8;
    if (splits > max_splits) splits = max_splits;
    if (rows <= 16 && splits > qp::TAIL_ROWS / mrows) splits = qp::TAIL_ROWS / mrows;
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

// Most parts (CTA ranges) any column block of a stream-K plan meets.
static long long streamk_max_parts(const qp::StreamKPlan& plan, int kunits, int nbk) {
    long long most = 0;
    for (int b = 0; b < nbk; ++b) {
        const long long parts =
            plan.owner((long long)(b + 1) * kunits - 1) - plan.owner((long long)b * kunits) + 1;
        if (parts > most) most = parts;
    }
    return most;
}

// The items of every CTA of a stream-K plan of `ctas` CTAs over nbk column blocks of kunits units, as the kernel
// walks them, for the CPU tests: rows of 8 ints (cta, nb, k0, k1, slot, seg_first, seg_last, the slot the block's
// summing CTA reads for this CTA's part) into out (room for max_items rows). Returns the item count, or -1 when
// out is too small.
QP_API int qp_trellis_mma_streamk_items_host(int kunits, int nbk, int ctas, int* out, int max_items) {
    const qp::StreamKPlan plan{(long long)kunits * nbk, ctas};
    int count = 0;
    for (int c = 0; c < ctas; ++c) {
        long long u = plan.start(c);
        for (int item = 0; u < plan.start(c + 1); ++item) {
            const qp::StreamKItem it = qp::streamk_item(plan, kunits, c, u, item);
            if (count >= max_items) return -1;
            int* row = out + 8 * count++;
            row[0] = c;
            row[1] = it.nb;
            row[2] = it.k0;
            row[3] = it.k1;
            row[4] = it.slot;
            row[5] = it.seg_first;
            row[6] = it.seg_last;
            row[7] = qp::streamk_slot(plan, kunits, c, it.nb);
            u += it.k1 - it.k0;
        }
    }
    return count;
}

// Stream-K plan of one call of up to 64 rows (one chunk): how many CTAs share the launch's k units (k / 128 of each
// 128-column block of n, blocks in order; qp::StreamKPlan), the most, up to target_ctas and one unit each, with
// which no column block meets more CTAs than its last CTA should sum (up to 16 rows TAIL_ROWS / rows partials, above
// WIDE_PARTS) and the partial slots (2 per CTA x rows x 128 floats) fit the workspace when any block is in parts.
// *parts: the most parts of one block (1: every block whole in one CTA). Each shape is planned once per process.
// Returns the CTA count (>= 1), or 0 above 64 rows or for a bad geometry.
static int streamk_plan(int rows, int k, int n, int target_ctas, long long partial_floats, int* parts) {
    if (rows <= 0 || rows > 64 || k <= 0 || k % 128 || n <= 0 || n % qp::BLOCK_N) return 0;
    using Key = std::tuple<int, int, int, int, long long>;
    static std::mutex lock;
    static std::map<Key, std::pair<int, int>> planned;
    const Key key{rows, k, n, target_ctas, partial_floats};
    {
        std::lock_guard<std::mutex> guard(lock);
        const auto hit = planned.find(key);
        if (hit != planned.end()) {
            *parts = hit->second.second;
            return hit->second.first;
        }
    }
    const int kunits = k / 128, nbk = n / qp::BLOCK_N;
    const long long units = (long long)kunits * nbk;
    const long long max_parts = rows <= 16 ? qp::TAIL_ROWS / rows : qp::WIDE_PARTS;
    long long ctas = target_ctas < 1 ? 1 : target_ctas;
    if (ctas > units) ctas = units;
    long long most = 1;
    for (; ctas >= 1; --ctas) {
        most = streamk_max_parts(qp::StreamKPlan{units, (int)ctas}, kunits, nbk);
        if (most == 1 || (most <= max_parts && 2 * ctas * rows * qp::BLOCK_N <= partial_floats)) break;
    }
    if (ctas < 1) ctas = 1, most = 1;  // one CTA: every block whole
    std::lock_guard<std::mutex> guard(lock);
    if (planned.size() > 4096) planned.clear();
    planned[key] = {(int)ctas, (int)most};
    *parts = (int)most;
    return (int)ctas;
}

QP_API int qp_trellis_mma_streamk_ctas(int rows, int k, int n, int target_ctas, long long partial_floats) {
    int parts = 0;
    return streamk_plan(rows, k, n, target_ctas, partial_floats, &parts);
}

// `shards` EXL3 shards sharing the input x, in one launch: out[:, col[i]:col[i] + out_features[i]] = (x @ W_i)[:,
// :out_features[i]]. trellis / suh / svh / n / col / out_features are host arrays of `shards` entries (device
// pointers in the first three). xh holds shards x rows rows of k. At one row with `inline_rows` >= 1 each CTA
// transforms its own input panel; otherwise up to 16 rows one transform launch writes every shard's had128(x * suh)
// to xh (shards x rows x k fp16) and the GEMM streams its slices from there; above 16 rows likewise in 64-row
// chunks. With `stream_k` (up to 64 rows) the CTAs that fit share the k units of every column block evenly
// (qp_trellis_mma_streamk_ctas) instead of whole splits. Returns 0, a CUDA error code, or -1 (bad geometry), -2 (no
// kernel for this K), -3 (bad codebook), -4 (workspace too small, or no xh where one is needed), -5 (no shard or more
// than MAX_SHARDS).
QP_API int qp_trellis_mma(const void* x, void* xh, const void* const* trellis, const void* const* suh,
                          const void* const* svh, const int* n, const int* col, const int* out_features, int shards,
                          void* out, float* partials, long long partial_floats, int* counters, long long counters_len,
                          int rows, int x_width, int x_stride, int k, int out_stride, int codebook, int k2, int bf16,
                          int target_ctas, int inline_rows, int stream_k, void* stream) {
    if (rows <= 0) return 0;
    const int small = rows <= 16;                    // one 16-row fragment (MB = 1), several shards allowed
    const int fused = rows == 1 && inline_rows >= 1;  // the input transform inside the GEMM's CTAs (one row)
    if (shards < 1 || shards > qp::MAX_SHARDS) return -5;
    if (k % 128 || k <= 0 || x_width > k) return -1;
    qp::Params p{};
    int n_total = 0;
    for (int i = 0; i < shards; ++i) {
        if (n[i] % 128 || n[i] <= 0 || out_features[i] > n[i]) return -1;
        p.shard[i] = qp::Shard{static_cast<const uint8_t*>(trellis[i]), static_cast<const __half*>(suh[i]),
                               static_cast<const __half*>(svh[i]), n[i], col[i], out_features[i],
                               n_total / qp::BLOCK_N};
        n_total += n[i];
    }
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int mb_rows = small ? 16 : 64;
    // one wave is what fits at once (a target above what fits would split k more finely for a grid of two waves,
    // measured slower: docs/kernels.md)
    const bool streamk = stream_k && rows <= 64;
    int fit = 0, sms = 0;
    int e = streamk ? (fused   ? qp::resident_ctas<1, true, true>(codebook, k2, &fit)
                       : small ? qp::resident_ctas<1, false, true>(codebook, k2, &fit)
                               : qp::resident_ctas<4, false, true>(codebook, k2, &fit))
            : fused ? qp::resident_ctas<1, true>(codebook, k2, &fit)
            : small ? qp::resident_ctas<1, false>(codebook, k2, &fit)
                    : qp::resident_ctas<4, false>(codebook, k2, &fit);
    if (e != 0) return e;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
        return (int)cudaGetLastError();
    if ((long long)fit * sms < target_ctas) target_ctas = fit * sms;
    const int splits = qp_trellis_mma_splits(rows, k, n_total, target_ctas, partial_floats, counters_len);
    const int ktiles = k / 16;
    const int slice = (ktiles / 8 + splits - 1) / splits * 8;  // a multiple of 8 tiles (TileStream::panel())
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
    p.slice_tiles = slice;
    p.splits = splits;
    p.mrows = rows < mb_rows ? rows : mb_rows;
    p.bf16 = bf16;
    const int chunks = (rows + mb_rows - 1) / mb_rows;
    if (splits > 1 && ((long long)chunks * splits * p.mrows * n_total > partial_floats ||
                       (long long)chunks * (n_total / qp::BLOCK_N) > counters_len))
        return -4;
    dim3 grid(n_total / qp::BLOCK_N, splits, chunks);
    if (streamk) {
        int parts = 0;
        p.ctas = streamk_plan(rows, k, n_total, target_ctas, partial_floats, &parts);
        p.units = (long long)(k / 128) * (n_total / qp::BLOCK_N);
        if (p.ctas < 1 || (parts > 1 && (2LL * p.ctas * p.mrows * qp::BLOCK_N > partial_floats ||
                                         (long long)(n_total / qp::BLOCK_N) > counters_len)))
            return -4;
        grid = dim3(p.ctas, 1, 1);
    }
    if (fused)
        return streamk ? qp::dispatch<1, true, true>(p, codebook, k2, grid, s)
                       : qp::dispatch<1, true>(p, codebook, k2, grid, s);
    if (xh == nullptr) return -4;
    const long items = (long)shards * rows * (k / 128);
    qp::input_transform_kernel<<<(unsigned)((items + qp::WARPS - 1) / qp::WARPS), qp::THREADS, 0, s>>>(p);
    e = (int)cudaGetLastError();
    if (e != 0) return e;
    if (streamk)
        return small ? qp::dispatch<1, false, true>(p, codebook, k2, grid, s)
                     : qp::dispatch<4, false, true>(p, codebook, k2, grid, s);
    return small ? qp::dispatch<1, false>(p, codebook, k2, grid, s) : qp::dispatch<4, false>(p, codebook, k2, grid, s);
}

namespace qp {

template <int CB, int KA, bool HALFK>
void decode_tile_host(const uint32_t* words, uint16_t* out) {
    for (int lane = 0; lane < 32; ++lane) {
        int widx[Tile<KA, HALFK>::NORM + 1], shift;
        lane_window<KA, HALFK>(lane, widx, shift);
        uint32_t b[4];
        decode_lane<CB, KA, HALFK>(words, widx, shift, b);
        // the mma.m16n8k16 B fragment: b[h] holds rows 2 * (lane % 4) (+1) (+8 for odd h) of column lane / 4 (+8 for
        // h >= 2), low half first
        const int r0 = 2 * (lane % 4), c0 = lane / 4;
        for (int h = 0; h < 4; ++h)
            for (int e = 0; e < 2; ++e)
                out[(r0 + 8 * (h & 1) + e) * 16 + c0 + 8 * (h >> 1)] = (uint16_t)(b[h] >> (16 * e));
    }
}

}  // namespace qp

// The kernels' decode of one tile, run on the host: `words` are the tile's uint32 words, `out` receives the 256 fp16
// bit patterns at [row * 16 + column] as the kernels place them in their mma fragments. Returns 0, -2 (no such K) or
// -3 (bad codebook). For tests without a GPU.
QP_API int qp_decode_tile_host(const uint32_t* words, int codebook, int k2, uint16_t* out) {
    return qp::with_codebook_k(codebook, k2, [&](auto cb, auto ka, auto half) {
        qp::decode_tile_host<decltype(cb)::value, decltype(ka)::value, decltype(half)::value>(words, out);
        return 0;
    });
}

// ------------------------------------------------------------------------------------------------------------------
// Expert banks (docs/moe-bank.md): one MoE layer's routed experts in four kinds of launch per call, each expert's
// trellis read once per 16 of its routed tokens, graph-safe (every size below depends on the token count only).
//
//   route     one CTA: each pick (token t, choice j; pick index t * top_k + j) gets its expert's physical slot
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
// split order, so results do not depend on the order in which the route kernel bucketed the picks.
// ------------------------------------------------------------------------------------------------------------------

namespace qp {

constexpr int MOE_ROWS = 16;          // rows per work item (one mma fragment)
constexpr int MOE_MAX_GROUPS = 16;    // K groups one bank may have
constexpr int MOE_ROUTE_THREADS = 1024;

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
    float* partials;               // split-K partials: (grid z, splits, 16, n)
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
};

__device__ __forceinline__ float load_weight(const void* w, int i, int dtype) {
    if (dtype == 0) return static_cast<const float*>(w)[i];
    if (dtype == 1) return __half2float(static_cast<const __half*>(w)[i]);
    return __bfloat162float(static_cast<const __nv_bfloat16*>(w)[i]);
}

// The work items of slots lo .. hi - 1 given their pick counts, numbered from `item`; offsets of their sorted picks
// from `pos`. Host and device (the route kernel's one serial step), so a test checks the plan on the CPU.
__host__ __device__ inline void moe_plan_groups(const int* counts, int E, const int* group_lo, int groups,
                                                int* offsets, int* group_work, int* item_base) {
    int pos = 0, item = 0;
    for (int g = 0; g < groups; ++g) {
        group_work[g] = item;
        const int lo = group_lo[g], hi = g + 1 < groups ? group_lo[g + 1] : E;
        for (int s = lo; s < hi; ++s) {
            offsets[s] = pos;
            item_base[s] = item;
            pos += counts[s];
            item += (counts[s] + MOE_ROWS - 1) / MOE_ROWS;
        }
    }
    offsets[E] = pos;
    group_work[groups] = item;
}

struct MoeRoute {
    const void* ids;        // (slots,) logical expert ids, int32 or int64 (ids64)
    const long long* perm;  // (E + 1,) expert id -> slot, last entry -1 (id -1 reads it)
    int ids64, slots, E;
    int groups;
    int group_lo[MOE_MAX_GROUPS];
    int* slot_of;     // (slots,) each pick's slot, -1 when another rank holds its expert
    int* offsets;     // (E + 1,)
    int* sorted;      // (slots,)
    int* work;        // (2 * items,)
    int* group_work;  // (groups + 1,)
};

// One CTA; dynamic shared memory: counts, cursors and item bases of E slots, E + 1 offsets.
__global__ void __launch_bounds__(MOE_ROUTE_THREADS) moe_route_kernel(const MoeRoute r) {
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
    if (threadIdx.x == 0) moe_plan_groups(counts, r.E, r.group_lo, r.groups, offsets, r.group_work, item_base);
    __syncthreads();
    for (int s = threadIdx.x; s <= r.E; s += blockDim.x) r.offsets[s] = offsets[s];
    for (int s = threadIdx.x; s < r.E; s += blockDim.x)
        for (int row = 0; row < counts[s]; row += MOE_ROWS) {
            const int item = item_base[s] + row / MOE_ROWS;
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
    const int nb = blockIdx.x, split = blockIdx.y, z = blockIdx.z;
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

    if (p.splits > 1) {
        const size_t n0 = (size_t)nb * BLOCK_N;
        float* mine = p.partials + ((size_t)(z * p.splits + split) * MOE_ROWS) * p.n + n0;
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
        const float* all = p.partials + ((size_t)z * p.splits * MOE_ROWS) * p.n + n0;
        for (int e = threadIdx.x * 4; e < rows * BLOCK_N; e += THREADS * 4) {
            const size_t at = (size_t)(e / BLOCK_N) * p.n + e % BLOCK_N;
            float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int sp = 0; sp < p.splits; ++sp) {
                const float4 v = __ldcg(reinterpret_cast<const float4*>(all + (size_t)sp * MOE_ROWS * p.n + at));
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
            const int pick = p.sorted[row_pick[m]];
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
    int g = 0;
#pragma unroll
    for (int i = 1; i < MOE_MAX_GROUPS; ++i)
        if (i < p.groups && w >= p.group_work[i]) g = i;
    switch (p.group_k2[g]) {
        case 2: moe_cta<CB, 1, false, DOWN>(p, w, smem, row_pick, last_arrival); break;
        case 4: moe_cta<CB, 2, false, DOWN>(p, w, smem, row_pick, last_arrival); break;
        case 6: moe_cta<CB, 3, false, DOWN>(p, w, smem, row_pick, last_arrival); break;
        case 8: moe_cta<CB, 4, false, DOWN>(p, w, smem, row_pick, last_arrival); break;
        case 10: moe_cta<CB, 5, false, DOWN>(p, w, smem, row_pick, last_arrival); break;
        case 12: moe_cta<CB, 6, false, DOWN>(p, w, smem, row_pick, last_arrival); break;
        case 14: moe_cta<CB, 7, false, DOWN>(p, w, smem, row_pick, last_arrival); break;
        case 16: moe_cta<CB, 8, false, DOWN>(p, w, smem, row_pick, last_arrival); break;
        default:
            if constexpr (CB == CB_MUL1) {  // half-integer K: mul1 only (the host refuses others)
                switch (p.group_k2[g]) {
                    case 3: moe_cta<CB, 1, true, DOWN>(p, w, smem, row_pick, last_arrival); break;
                    case 5: moe_cta<CB, 2, true, DOWN>(p, w, smem, row_pick, last_arrival); break;
                    case 7: moe_cta<CB, 3, true, DOWN>(p, w, smem, row_pick, last_arrival); break;
                    default: break;
                }
            }
            break;
    }
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

// Work items a K group of `group_slots` slots can have for `slots` picks at most: each non-empty slot one item more
// than its share of whole 16-row items.
QP_API int qp_moe_items(int slots, int group_slots) {
    return (group_slots < slots ? group_slots : slots) + (slots + qp::MOE_ROWS - 1) / qp::MOE_ROWS;
}

// k splits of one expert launch: as many as keep `items` x (n / 128) x splits within target_ctas (whole 128-column
// blocks of k per split), within the workspace's partials and counters.
QP_API int qp_moe_splits(int items, int k, int n, int target_ctas, long long partial_floats, long long counters) {
    const int ktiles = k / 16, nbk = n / qp::BLOCK_N;
    const long long ctas = (long long)nbk * items;
    int splits = (int)(target_ctas / (ctas > 0 ? ctas : 1));
    if (splits > ktiles / 8) splits = ktiles / 8;
    if (splits > qp::TAIL_ROWS / qp::MOE_ROWS) splits = qp::TAIL_ROWS / qp::MOE_ROWS;
    if (splits < 1) splits = 1;
    int slice = (ktiles / 8 + splits - 1) / splits * 8;
    splits = (ktiles + slice - 1) / slice;
    while (splits > 1 && ((long long)items * splits * qp::MOE_ROWS * n > partial_floats || ctas > counters)) {
        splits /= 2;
        slice = (ktiles / 8 + splits - 1) / splits * 8;
        splits = (ktiles + slice - 1) / slice;
    }
    return splits;
}

// The route step's plan on the host (for tests): offsets (E + 1), group_work (groups + 1) and each slot's first work
// item (E) from per-slot pick counts.
QP_API void qp_moe_plan_host(const int* counts, int E, const int* group_lo, int groups, int* offsets, int* group_work,
                             int* item_base) {
    qp::moe_plan_groups(counts, E, group_lo, groups, offsets, group_work, item_base);
}

// Route `slots` picks (ids: int32 or int64 expert ids, -1 for another rank's) over E slots in `groups` K groups
// (group_lo: host array, the first slot of each). Returns 0, a CUDA error code, or -1 (bad sizes).
QP_API int qp_moe_route(const void* ids, int ids64, const long long* perm, int slots, int E, const int* group_lo,
                        int groups, int* slot_of, int* offsets, int* sorted, int* work, int* group_work, void* stream) {
    if (slots <= 0 || E <= 0 || groups < 1 || groups > qp::MOE_MAX_GROUPS || group_lo[0] != 0) return -1;
    qp::MoeRoute r{};
    r.ids = ids;
    r.perm = perm;
    r.ids64 = ids64;
    r.slots = slots;
    r.E = E;
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
    qp::moe_route_kernel<<<1, qp::MOE_ROUTE_THREADS, smem, static_cast<cudaStream_t>(stream)>>>(r);
    return (int)cudaGetLastError();
}

namespace qp {

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

// The split plan of a launch of `items` work items whose kernel fits `fit` CTAs per SM. Returns 0, a CUDA error
// code or -4 (workspace too small).
inline int moe_plan(MoeParams& p, int fit, int items, int target_ctas, long long partial_floats,
                    long long counters_len) {
    int sms = 0, device = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
        return (int)cudaGetLastError();
    if ((long long)fit * sms < target_ctas) target_ctas = fit * sms;
    p.splits = qp_moe_splits(items, p.k, p.n, target_ctas, partial_floats, counters_len);
    const int ktiles = p.k / 16;
    p.slice_tiles = (ktiles / 8 + p.splits - 1) / p.splits * 8;  // a multiple of 8 tiles (TileStream::panel())
    if (p.splits > 1 && ((long long)items * p.splits * MOE_ROWS * p.n > partial_floats ||
                         (long long)items * (p.n / BLOCK_N) > counters_len))
        return -4;
    return 0;
}

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
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e != cudaSuccess) return (int)e;
    int& cached = fits[device & 63][k2max];  // k2max: 2..16, checked by moe_smem
    if (cached == 0) {
        auto kernel = trellis_moe_kernel<CB, DOWN>;
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, moe_smem_bytes<8, false>());
        if (e != cudaSuccess) return (int)e;
        int n = 0;
        e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, THREADS, smem);
        if (e != cudaSuccess) return (int)e;
        cached = n > 0 ? n : 1;
    }
    *fit = cached;
    return 0;
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
    e = qp::moe_plan(p, fit, items, target_ctas, partial_floats, counters_len);
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
