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
//   1. A panel of the transformed input had128(x * suh) (fp16, up to 1024 columns) is built in shared memory: from x
//      directly when the rows fit one fragment (FUSED: rows <= 16, the decode case), else copied from a buffer the
//      transform kernel below wrote once for all column blocks.
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
    const void* xh;  // (rows, k) fp16 had128(x * suh), row stride k (non-fused kernels only, one shard)
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
        return half2_add(byte_perm(xa, xb, 0x5410), byte_perm(xa, xb, 0x7632));
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
// columns 8-15), from the tile's words `tw` (shared or host memory).
template <int CB, int KA, bool HALFK>
__host__ __device__ __forceinline__ void decode_lane(const uint32_t* tw, const int (&widx)[Tile<KA, HALFK>::NORM + 1],
                                                     int shift, uint32_t (&b)[4]) {
    using T = Tile<KA, HALFK>;
    uint32_t raw[T::NORM + 1];
#pragma unroll
    for (int j = 0; j <= T::NORM; ++j) raw[j] = tw[widx[j]];
    uint32_t w[T::NORM];
#pragma unroll
    for (int j = 0; j < T::NORM; ++j) w[j] = funnel_l(raw[j + 1], raw[j], shift);
    b[0] = decode_pair<CB>(state_of<KA, HALFK, 0>(w), state_of<KA, HALFK, 1>(w));
    b[1] = decode_pair<CB>(state_of<KA, HALFK, 2>(w), state_of<KA, HALFK, 3>(w));
    b[2] = decode_pair<CB>(state_of<KA, HALFK, 4>(w), state_of<KA, HALFK, 5>(w));
    b[3] = decode_pair<CB>(state_of<KA, HALFK, 6>(w), state_of<KA, HALFK, 7>(w));
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

template <int CB, int KA, bool HALFK, int MB, bool FUSED>
__global__ void __launch_bounds__(THREADS) trellis_mma_kernel(const Params p) {
    using T = Tile<KA, HALFK>;
    constexpr int MROWS = 16 * MB;
    constexpr int PANEL = MB == 1 ? 64 : 32;  // k tiles of A held in shared memory at once
    constexpr int A_STRIDE = PANEL * 16 + 8;  // halves; +16 bytes keeps ldmatrix rows on distinct banks
    constexpr int A_BYTES = MROWS * A_STRIDE * 2;
    constexpr int F_BYTES = MROWS * F_STRIDE * 4;
    constexpr int AF_BYTES = A_BYTES > F_BYTES ? A_BYTES : F_BYTES;

    extern __shared__ __align__(16) uint8_t smem[];
    __half* A = reinterpret_cast<__half*>(smem);
    float* F = reinterpret_cast<float*>(smem);
    uint32_t* ring = reinterpret_cast<uint32_t*>(smem + AF_BYTES);
    __shared__ int last_arrival;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int nb = blockIdx.x, split = blockIdx.y, chunk = blockIdx.z;
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
    const int kt0 = split * p.slice_tiles;
    const int ktiles = min(p.slice_tiles, p.k / 16 - kt0);

    // this warp's tile column, streamed through its cp.async ring: group g holds tiles GROUP * g .. + GROUP - 1
    constexpr int GROUP_WORDS = GROUP * T::WORDS;
    constexpr int PIECES = GROUP * T::CHUNKS;  // 16-byte pieces per group
    constexpr int PER_LANE = (PIECES + 31) / 32;
    const int tn = lnb * (BLOCK_N / 16) + warp;
    uint32_t* wring = ring + warp * GROUPS_IN_FLIGHT * GROUP_WORDS;
    const size_t tile_stride = (size_t)ntiles_n * T::BYTES;
    const uint8_t* tiles = trellis + ((size_t)kt0 * ntiles_n + tn) * T::BYTES;
    size_t src_off[PER_LANE];  // this lane's pieces: (tile in group, 16-byte piece) -> offset from the group's start
#pragma unroll
    for (int r = 0; r < PER_LANE; ++r) {
        const int c = lane + 32 * r;
        src_off[r] = (size_t)(c / T::CHUNKS) * tile_stride + (c % T::CHUNKS) * 16;
    }
    const int ngroups = ktiles / GROUP;
    auto issue = [&](int g) {
        if (g < ngroups) {
            const uint8_t* src = tiles + (size_t)g * GROUP * tile_stride;
            uint32_t* dst = wring + (g % GROUPS_IN_FLIGHT) * GROUP_WORDS;
#pragma unroll
            for (int r = 0; r < PER_LANE; ++r)
                if (PIECES % 32 == 0 || lane + 32 * r < PIECES) cp_async16(dst + (lane + 32 * r) * 4, src + src_off[r]);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int g = 0; g < GROUPS_IN_FLIGHT - 1; ++g) issue(g);

    int widx[T::NORM + 1], shift0;
    lane_window<KA, HALFK>(lane, widx, shift0);
    const __half* a_lane = A + (lane % 16) * A_STRIDE + (lane / 16) * 8;

    float acc[MB][2][4];
#pragma unroll
    for (int m = 0; m < MB; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][h][e] = 0.0f;

    for (int p0 = 0; p0 < ktiles; p0 += PANEL) {
        const int ptiles = min(PANEL, ktiles - p0);
        // 1. the A panel: rows x (ptiles * 16) fp16, zero rows beyond this chunk's rows
        __syncthreads();
        const int kc0 = (kt0 + p0) * 16;
        if constexpr (FUSED) {
            // rows x blocks items of 128 columns, PANEL_BATCH per warp loaded before any is transformed
            const int blocks = ptiles / 8, items = MROWS * blocks;
            for (int item0 = warp * PANEL_BATCH; item0 < items; item0 += WARPS * PANEL_BATCH) {
                float v[PANEL_BATCH][4];
#pragma unroll
                for (int j = 0; j < PANEL_BATCH; ++j) {
                    const int item = item0 + j, m = item / blocks;
#pragma unroll
                    for (int i = 0; i < 4; ++i) v[j][i] = 0.0f;
                    if (item < items && m < rows)
                        input_load(p, field(p, si, &Shard::suh), row0 + m, kc0 + item % blocks * 128, lane, v[j]);
                }
#pragma unroll
                for (int j = 0; j < PANEL_BATCH; ++j) {
                    const int item = item0 + j;
                    if (item < items) {  // warp-uniform
                        if (item / blocks < rows) input_transform(v[j], lane);  // padding rows stay zero
                        __half2* dst = reinterpret_cast<__half2*>(A + item / blocks * A_STRIDE + item % blocks * 128 +
                                                                  lane * 4);
                        dst[0] = __floats2half2_rn(v[j][0], v[j][1]);
                        dst[1] = __floats2half2_rn(v[j][2], v[j][3]);
                    }
                }
            }
        } else {
            // copied by cp.async (every piece in flight at once), rows beyond the chunk zeroed; the wait below also
            // drains the warps' trellis rings, whose accounting only needs at most GROUPS_IN_FLIGHT - 1 pending
            const int pieces = ptiles * 2;  // 16-byte pieces per row
            const __half* xh = static_cast<const __half*>(p.xh);
            for (int item = threadIdx.x; item < MROWS * pieces; item += THREADS) {
                const int m = item / pieces, q = item % pieces;
                __half* dst = A + m * A_STRIDE + q * 8;
                if (m < rows)
                    cp_async16(dst, xh + (size_t)(row0 + m) * p.k + kc0 + q * 8);
                else
                    *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
            }
            cp_async_commit();
            cp_async_wait<0>();
        }
        __syncthreads();

        // 2. decode and multiply the panel's tiles, a group at a time
        for (int g = p0 / GROUP; g < (p0 + ptiles) / GROUP; ++g) {
            issue(g + GROUPS_IN_FLIGHT - 1);
            cp_async_wait<GROUPS_IN_FLIGHT - 1>();
            __syncwarp();
            const uint32_t* gw = wring + (g % GROUPS_IN_FLIGHT) * GROUP_WORDS;
#pragma unroll
            for (int u = 0; u < GROUP; ++u) {
                uint32_t b[4];
                decode_lane<CB, KA, HALFK>(gw + u * T::WORDS, widx, shift0, b);

                const int kl = (g * GROUP + u - p0) * 16;
#pragma unroll
                for (int m = 0; m < MB; ++m) {
                    uint32_t a[4];
                    ldmatrix_x4(a, a_lane + m * 16 * A_STRIDE + kl);
                    mma16816(acc[m][0], a, b[0], b[1]);
                    mma16816(acc[m][1], a, b[2], b[3]);
                }
            }
            __syncwarp();  // every lane has read the group before a later issue() refills its slot
        }
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

    if (p.splits > 1) {
        // partials and their sum move as float4 (a row's 128 columns are 32 of them; rows start 16-byte aligned in
        // the workspace, n being a multiple of 128, and in F, F_STRIDE a multiple of 4)
        const size_t n0 = (size_t)nb * BLOCK_N;
        float* mine = p.partials + ((size_t)(chunk * p.splits + split) * p.mrows) * p.n + n0;
        for (int e = threadIdx.x * 4; e < rows * BLOCK_N; e += THREADS * 4)
            *reinterpret_cast<float4*>(mine + (size_t)(e / BLOCK_N) * p.n + e % BLOCK_N) =
                *reinterpret_cast<const float4*>(F + (e / BLOCK_N) * F_STRIDE + e % BLOCK_N);
        __threadfence();
        __syncthreads();
        int* counter = p.counters + (size_t)chunk * gridDim.x + nb;
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

// had128(x * suh) / sqrt(128) of every row into xh (fp16, row stride k) for the launch's one shard: one warp per
// 128-column block.
__global__ void __launch_bounds__(THREADS) input_transform_kernel(const Params p) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int blocks = p.k / 128;
    const long item = (long)blockIdx.x * WARPS + warp;
    if (item >= (long)p.rows * blocks) return;
    const int row = item / blocks, b = item % blocks;
    float v[4];
    input_load(p, p.shard[0].suh, row, b * 128, lane, v);
    input_transform(v, lane);
    __half2* dst = reinterpret_cast<__half2*>(static_cast<__half*>(const_cast<void*>(p.xh)) + (size_t)row * p.k +
                                              b * 128 + lane * 4);
    dst[0] = __floats2half2_rn(v[0], v[1]);
    dst[1] = __floats2half2_rn(v[2], v[3]);
}

// Dynamic shared memory of one kernel instantiation: the A panel (or, after it, the 128-column partial sums) and the
// warps' trellis rings.
template <int KA, bool HALFK, int MB>
constexpr int smem_bytes() {
    constexpr int MROWS = 16 * MB;
    constexpr int PANEL = MB == 1 ? 64 : 32;
    constexpr int A_BYTES = MROWS * (PANEL * 16 + 8) * 2;
    constexpr int F_BYTES = MROWS * F_STRIDE * 4;
    return (A_BYTES > F_BYTES ? A_BYTES : F_BYTES) + WARPS * GROUPS_IN_FLIGHT * GROUP * Tile<KA, HALFK>::BYTES;
}

// Raises a kernel instantiation's shared-memory limit once per device (at warm-up, before any CUDA-graph capture)
// and gives how many of its CTAs fit in one SM at once (*fit; cached with the limit). Returns 0 or a CUDA error code.
template <int CB, int KA, bool HALFK, int MB, bool FUSED>
int configure(int* fit) {
    static int fits[64] = {};  // per device; 0 = not configured yet
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e != cudaSuccess) return (int)e;
    int& cached = fits[device & 63];
    if (cached == 0) {
        auto kernel = trellis_mma_kernel<CB, KA, HALFK, MB, FUSED>;
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<KA, HALFK, MB>());
        if (e != cudaSuccess) return (int)e;
        int n = 0;
        e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, THREADS, smem_bytes<KA, HALFK, MB>());
        if (e != cudaSuccess) return (int)e;
        cached = n > 0 ? n : 1;
    }
    *fit = cached;
    return 0;
}

template <int CB, int KA, bool HALFK, int MB, bool FUSED>
int launch(const Params& p, dim3 grid, cudaStream_t stream) {
    int fit = 0;
    const int e = configure<CB, KA, HALFK, MB, FUSED>(&fit);
    if (e != 0) return e;
    trellis_mma_kernel<CB, KA, HALFK, MB, FUSED><<<grid, THREADS, smem_bytes<KA, HALFK, MB>(), stream>>>(p);
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

template <int MB, bool FUSED>
int dispatch(const Params& p, int codebook, int k2, dim3 grid, cudaStream_t s) {
    return with_codebook_k(codebook, k2, [&](auto cb, auto ka, auto half) {
        return launch<decltype(cb)::value, decltype(ka)::value, decltype(half)::value, MB, FUSED>(p, grid, s);
    });
}

// CTAs of the kernel a launch of (codebook, 2K, MB, FUSED) uses that fit in one SM at once (*fit). Returns 0, a CUDA
// error code, -2 (no such K) or -3 (bad codebook).
template <int MB, bool FUSED>
int resident_ctas(int codebook, int k2, int* fit) {
    return with_codebook_k(codebook, k2, [&](auto cb, auto ka, auto half) {
        return configure<decltype(cb)::value, decltype(ka)::value, decltype(half)::value, MB, FUSED>(fit);
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

// `shards` EXL3 shards sharing the input x, in one launch: out[:, col[i]:col[i] + out_features[i]] = (x @ W_i)[:,
// :out_features[i]]. trellis / suh / svh / n / col / out_features are host arrays of `shards` entries (device
// pointers in the first three). More than one shard needs rows <= 16. Returns 0, a CUDA error code, or -1 (bad
// geometry), -2 (no kernel for this K), -3 (bad codebook), -4 (workspace too small), -5 (several shards above 16 rows
// or more than MAX_SHARDS).
QP_API int qp_trellis_mma(const void* x, void* xh, const void* const* trellis, const void* const* suh,
                          const void* const* svh, const int* n, const int* col, const int* out_features, int shards,
                          void* out, float* partials, long long partial_floats, int* counters, long long counters_len,
                          int rows, int x_width, int x_stride, int k, int out_stride, int codebook, int k2, int bf16,
                          int target_ctas, void* stream) {
    if (rows <= 0) return 0;
    const int fused = rows <= 16;
    if (shards < 1 || shards > qp::MAX_SHARDS || (shards > 1 && !fused)) return -5;
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
    const int mb_rows = fused ? 16 : 64;
    // one wave is what fits at once: above 16 rows the kernel's 70-99 KB of shared memory holds 2-3 CTAs per SM, so
    // a target of 4 per SM would split k twice as finely for a grid of two waves (measured slower: docs/kernels.md)
    int fit = 0, sms = 0;
    int e = fused ? qp::resident_ctas<1, true>(codebook, k2, &fit) : qp::resident_ctas<4, false>(codebook, k2, &fit);
    if (e != 0) return e;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
        return (int)cudaGetLastError();
    if ((long long)fit * sms < target_ctas) target_ctas = fit * sms;
    const int splits = qp_trellis_mma_splits(rows, k, n_total, target_ctas, partial_floats, counters_len);
    const int ktiles = k / 16;
    const int slice = (ktiles / 8 + splits - 1) / splits * 8;
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
    const dim3 grid(n_total / qp::BLOCK_N, splits, chunks);
    if (fused) return qp::dispatch<1, true>(p, codebook, k2, grid, s);
    if (xh == nullptr) return -4;
    const long items = (long)rows * (k / 128);
    qp::input_transform_kernel<<<(unsigned)((items + qp::WARPS - 1) / qp::WARPS), qp::THREADS, 0, s>>>(p);
    e = (int)cudaGetLastError();
    if (e != 0) return e;
    return qp::dispatch<4, false>(p, codebook, k2, grid, s);
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
