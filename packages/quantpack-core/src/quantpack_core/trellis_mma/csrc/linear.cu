// Trellis linear layers for few rows: the trellis is decoded in registers straight into tensor-core fragments.
//
// y = had128(had128(x * suh) @ What) * svh for one trellis shard (docs/exl3-format.md, "The math"), where What is stored
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
// with nvcc alone and loads with ctypes (quantpack_core/trellis_mma/library.py).

#include "common.cuh"
#include "linear.cuh"

namespace qp {

constexpr int PANEL_BATCH = 2;  // input blocks a warp loads before transforming them (memory-level parallelism)

// Dynamic shared memory of one kernel instantiation: the A panel (or, after it, the 128-column partial sums) and the
// warps' trellis rings.
template <int KA, bool HALFK, int MB, bool FUSED>
__host__ __device__ constexpr int smem_bytes() {
    constexpr int MROWS = 16 * MB;
    constexpr int A_BYTES = FUSED ? (64 * 16 + 8) * 2 : ARing<MB>::BYTES;  // FUSED: one row (cta_item)
    constexpr int F_BYTES = MROWS * F_STRIDE * 4;
    return (A_BYTES > F_BYTES ? A_BYTES : F_BYTES) + WARPS * GROUPS_IN_FLIGHT * GROUP * Tile<KA, HALFK>::BYTES;
}

// The CTA's work: the chunk's rows x column block nb x k tiles [kt0, kt0 + ktiles) of split `split`; its partial goes
// to the split's rows of the workspace and the block's last CTA sums the p.splits partials. Returns early (nothing
// left to do) when another CTA sums.
template <int CB, int KA, bool HALFK, int MB, bool FUSED>
__device__ __forceinline__ void cta_item(const Params& p, uint8_t* smem, int& last_arrival, const int nb, const int kt0,
                                         const int ktiles, const int chunk, const int split) {
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
    const int si = shard_of(p, nb);
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

    finish_block(p, F, last_arrival, si, nb, lnb, chunk, split, row0, rows);
}


// The split plan: a CTA per (column block, split, row chunk).
template <int CB, int KA, bool HALFK, int MB, bool FUSED>
__global__ void __launch_bounds__(THREADS) trellis_mma_kernel(const Params p) {
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ int last_arrival;
    const int split = blockIdx.y, kt0 = split * p.slice_tiles;
    cta_item<CB, KA, HALFK, MB, FUSED>(p, smem, last_arrival, blockIdx.x, kt0, min(p.slice_tiles, p.k / 16 - kt0),
                                       blockIdx.z, split);
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


int launch_input_transform(const Params& p, cudaStream_t s) {
    const long items = (long)p.shards * p.rows * (p.k / 128);
    input_transform_kernel<<<(unsigned)((items + WARPS - 1) / WARPS), THREADS, 0, s>>>(p);
    return (int)cudaGetLastError();
}

// Raises a kernel instantiation's shared-memory limit once per device (at warm-up, before any CUDA-graph capture)
// and gives how many of its CTAs fit in one SM at once (*fit; cached with the limit). Returns 0 or a CUDA error code.
template <int CB, int KA, bool HALFK, int MB, bool FUSED>
int configure(int* fit) {
    static int fits[64] = {};  // per device; 0 = not configured yet
    int slot = 0;
    if (const int e = device_slot(&slot)) return e;
    constexpr int smem = smem_bytes<KA, HALFK, MB, FUSED>();
    return configure_kernel(trellis_mma_kernel<CB, KA, HALFK, MB, FUSED>, smem, smem, fits[slot], fit);
}

template <int CB, int KA, bool HALFK, int MB, bool FUSED>
int launch(const Params& p, dim3 grid, cudaStream_t stream) {
    int fit = 0;
    const int e = configure<CB, KA, HALFK, MB, FUSED>(&fit);
    if (e != 0) return e;
    trellis_mma_kernel<CB, KA, HALFK, MB, FUSED><<<grid, THREADS, smem_bytes<KA, HALFK, MB, FUSED>(), stream>>>(p);
    return (int)cudaGetLastError();
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

// How many CTAs split k in a call of the split-K kernel (qp::split_count): chunks of 16 rows up to 16 rows, where a
// column block's last CTA sums at most TAIL_ROWS partial rows (splits x rows), else chunks of 64 rows.
QP_API int qp_trellis_mma_splits(int rows, int k, int n, int target_ctas, long long partial_floats,
                                 long long counters) {
    const int mb_rows = rows <= 16 ? 16 : 64;
    const int mrows = rows < mb_rows ? rows : mb_rows;
    const int tail = rows <= 16 ? qp::TAIL_ROWS / mrows : k / 128;
    return qp::split_count(rows, mb_rows, k, n, target_ctas, tail, partial_floats, counters);
}

namespace qp {

// The split plan of a launch of p.rows rows over p.n columns (p.splits, p.slice_tiles, p.mrows), within one wave of
// the kernel instantiation it uses (`fused`, `small`): what fits at once (a target above what fits would split k more
// finely for a grid of two waves, measured slower: docs/kernels.md) and target_ctas. Returns 0, a CUDA error code,
// -2 (no kernel for this K), -3 (bad codebook) or -4 (workspace too small).
inline int plan_splits(Params& p, bool fused, bool small, int codebook, int k2, int target_ctas,
                       long long partial_floats, long long counters_len) {
    int fit = 0, sms = 0;
    const int e = fused ? resident_ctas<1, true>(codebook, k2, &fit)
                  : small ? resident_ctas<1, false>(codebook, k2, &fit)
                          : resident_ctas<4, false>(codebook, k2, &fit);
    if (e != 0) return e;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
        return (int)cudaGetLastError();
    if ((long long)fit * sms < target_ctas) target_ctas = fit * sms;
    const int mb_rows = small ? 16 : 64;
    const int splits = qp_trellis_mma_splits(p.rows, p.k, p.n, target_ctas, partial_floats, counters_len);
    const int ktiles = p.k / 16;
    p.slice_tiles = (ktiles / 8 + splits - 1) / splits * 8;  // a multiple of 8 tiles (TileStream::panel())
    p.splits = splits;
    p.mrows = p.rows < mb_rows ? p.rows : mb_rows;
    const int chunks = (p.rows + mb_rows - 1) / mb_rows;
    if (splits > 1 && ((long long)chunks * splits * p.mrows * p.n > partial_floats ||
                       (long long)chunks * (p.n / BLOCK_N) > counters_len))
        return -4;
    return 0;
}

}  // namespace qp

// `shards` trellis shards sharing the input x, in one launch: out[:, col[i]:col[i] + out_features[i]] = (x @ W_i)[:,
// :out_features[i]]. trellis / suh / svh / n / col / out_features are host arrays of `shards` entries (device
// pointers in the first three). xh holds shards x rows rows of k. At one row with `inline_rows` >= 1 each CTA
// transforms its own input panel; otherwise up to 16 rows one transform launch writes every shard's had128(x * suh)
// to xh (shards x rows x k fp16) and the GEMM streams its slices from there; above 16 rows likewise in 64-row
// chunks. Returns 0, a CUDA error code, or -1 (bad geometry), -2 (no kernel for this K), -3 (bad codebook), -4
// (workspace too small, or no xh where one is needed), -5 (no shard or more than MAX_SHARDS).
QP_API int qp_trellis_mma(const void* x, void* xh, const void* const* trellis, const void* const* suh,
                          const void* const* svh, const int* n, const int* col, const int* out_features, int shards,
                          void* out, float* partials, long long partial_floats, int* counters, long long counters_len,
                          int rows, int x_width, int x_stride, int k, int out_stride, int codebook, int k2, int bf16,
                          int target_ctas, int inline_rows, void* stream) {
    if (rows <= 0) return 0;
    const int small = rows <= 16;                    // one 16-row fragment (MB = 1), several shards allowed
    const int fused = rows == 1 && inline_rows >= 1;  // the input transform inside the GEMM's CTAs (one row)
    if (shards < 1 || shards > qp::MAX_SHARDS) return -5;
    if (k % 128 || k <= 0 || x_width > k) return -1;
    qp::Params p{};
    int n_total = 0;
    int e = qp::fill_shards(p, trellis, suh, svh, n, col, out_features, shards, n_total);
    if (e != 0) return e;
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
    p.bf16 = bf16;
    e = qp::plan_splits(p, fused, small, codebook, k2, target_ctas, partial_floats, counters_len);
    if (e != 0) return e;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const dim3 grid(n_total / qp::BLOCK_N, p.splits, (rows + (small ? 16 : 64) - 1) / (small ? 16 : 64));
    if (fused) return qp::dispatch<1, true>(p, codebook, k2, grid, s);
    if (xh == nullptr) return -4;
    e = qp::launch_input_transform(p, s);
    if (e != 0) return e;
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
